# Tab completion for warmspec (and warmspec-edit) in bash; zsh can use it through bashcompinit.
#
#   bash:  source /path/to/clients/shell/warmspec.bash          (e.g. from ~/.bashrc)
#   zsh:   autoload -U +X bashcompinit && bashcompinit
#          source /path/to/clients/shell/warmspec.bash
#
# The subcommands and options are read from `warmspec --help` and `warmspec CMD --help` the first
# time they are needed in a shell (about 0.2 s each), so the completion follows the installed
# warmspec instead of a copy of its options that would go stale.

declare -A _warmspec_opts_cache 2>/dev/null || typeset -A _warmspec_opts_cache
_warmspec_commands_cache=""

# The subcommands, from the "{ask,serve,...}" in the usage line.
_warmspec_commands() {
  if [[ -z $_warmspec_commands_cache ]]; then
    _warmspec_commands_cache=$(COLUMNS=200 command warmspec --help 2>/dev/null |
      sed -n 's/^usage:[^{]*{\([^}]*\)}.*/\1/p' | head -n 1 | tr ',' ' ')
  fi
  printf '%s\n' "$_warmspec_commands_cache"
}

# A subcommand's options, one per line; an option that takes a value ends in "=".
_warmspec_options() {
  local cmd=$1 key=${1:-_} # "": warmspec's own options (an empty key is no array subscript)
  if [[ -z ${_warmspec_opts_cache[$key]} ]]; then
    # argparse lists options as "  -f FILE, --file FILE   help..." (help after two spaces).
    _warmspec_opts_cache[$key]=$(COLUMNS=200 command warmspec $cmd --help 2>/dev/null | awk '
      /^  -/ {
        spec = substr($0, 3); cut = index(spec, "  "); if (cut) spec = substr(spec, 1, cut - 1)
        n = split(spec, parts, ", ")
        for (i = 1; i <= n; i++) { m = split(parts[i], w, " "); print w[1] (m > 1 ? "=" : "") }
      }')
  fi
  printf '%s\n' "${_warmspec_opts_cache[$key]}"
}

_warmspec() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
  local cmd="" i
  for ((i = 1; i < COMP_CWORD; i++)); do
    if [[ ${COMP_WORDS[i]} != -* ]]; then
      cmd=${COMP_WORDS[i]}
      break
    fi
  done
  COMPREPLY=()
  if [[ -z $cmd ]]; then
    if [[ $cur == -* ]]; then
      COMPREPLY=($(compgen -W "$(_warmspec_options "" | tr -d '=')" -- "$cur"))
    else
      COMPREPLY=($(compgen -W "$(_warmspec_commands)" -- "$cur"))
    fi
    return
  fi
  local opts
  opts=$(_warmspec_options "$cmd")
  # The value of the option before the cursor.
  if [[ $prev == -* ]] && grep -qx -- "$prev=" <<<"$opts"; then
    case $prev in
      --workspace) COMPREPLY=($(compgen -d -- "$cur")) ;;
      -f | --file | --socket | --model | -m | --wheel) COMPREPLY=($(compgen -f -- "$cur")) ;;
    esac
    return
  fi
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$(tr -d '=' <<<"$opts")" -- "$cur"))
  fi
}

# warmspec-edit [-w] FILE INSTRUCTION [-- EDIT-OPTIONS]: a file first; after "--", edit's options.
_warmspec_edit() {
  local cur=${COMP_WORDS[COMP_CWORD]} i words=0 dashdash=0
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      --) dashdash=1 ;;
      -*) ;;
      *) words=$((words + 1)) ;;
    esac
  done
  COMPREPLY=()
  if ((dashdash)); then
    [[ $cur == -* ]] && COMPREPLY=($(compgen -W "$(_warmspec_options edit | tr -d '=')" -- "$cur"))
  elif [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "-w --write -h --help --" -- "$cur"))
  elif ((words == 0)); then
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}

complete -o default -F _warmspec warmspec
complete -o default -F _warmspec_edit warmspec-edit
