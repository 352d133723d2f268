-- Next-edit suggestions: after an edit (leaving insert mode, or a change made in normal mode) ask
-- the server for `warmspec/nextEdit` and mark where the next edit goes -- the text it replaces
-- highlighted (WarmspecNextEdit), the replacement after the line as virtual text
-- (WarmspecNextEditText) -- however far from the cursor. The key (<M-n> by default, normal and
-- insert mode) jumps there and applies it; the server then suggests the one after (a rename's
-- next occurrence), until none is left.

local core = require("warmspec")
local ghost = require("warmspec.ghost")
local api = vim.api

local N = {}

local ns = api.nvim_create_namespace("warmspec_next_edit")
N.namespace = ns

local opts = core.defaults.next_edit
local shown = nil -- { buf, tick, edit, srow, scol, erow, ecol }
local requested = nil -- { buf, tick } of the last request
local timer = nil
local reported = {}

-- Every suggestion shown and applied, for tests and scripts: set N.trace = {} to record
-- { kind = "shown" | "applied", edit } (off by default: an editing session keeps none).
N.trace = nil

function N.clear()
  if shown and api.nvim_buf_is_valid(shown.buf) then
    api.nvim_buf_clear_namespace(shown.buf, ns, 0, -1)
  end
  shown = nil
end

function N.current()
  return shown
end

local function lines_of(buf, first, last)
  return api.nvim_buf_get_lines(buf, first, last + 1, false)
end

-- Ask for the next edit of the current buffer (once per change of it).
function N.request()
  local buf, win = api.nvim_get_current_buf(), api.nvim_get_current_win()
  local client = core.attached(buf)
  if not client then
    return
  end
  local tick = api.nvim_buf_get_changedtick(buf)
  if requested and requested.buf == buf and requested.tick == tick then
    return
  end
  requested = { buf = buf, tick = tick }
  local pos = vim.lsp.util.make_position_params(win, client.offset_encoding)
  local params = { uri = pos.textDocument.uri, position = pos.position }
  core.request(client, "warmspec/nextEdit", params, core.guard(function(err, result)
    if err then
      if not reported[err.message] then
        reported[err.message] = true
        core.error("next edit: " .. tostring(err.message))
      end
      return
    end
    if not api.nvim_buf_is_valid(buf) or api.nvim_buf_get_changedtick(buf) ~= tick then
      return -- the buffer changed meanwhile: its own request follows
    end
    N.clear()
    local edit = result and result.edit
    if not edit or edit == vim.NIL then
      return
    end
    local r = edit.range
    local first = lines_of(buf, r.start.line, r["end"].line)
    local enc = client.offset_encoding
    local scol = ghost.byte_col(first[1] or "", r.start.character, enc)
    local ecol = ghost.byte_col(first[#first] or "", r["end"].character, enc)
    local erow = r["end"].line
    api.nvim_buf_set_extmark(buf, ns, r.start.line, scol, {
      end_row = erow, end_col = ecol, hl_group = "WarmspecNextEdit",
      virt_text = { { "  → " .. vim.split(edit.text, "\n", { plain = true })[1] ..
        (opts.key and ("  (" .. opts.key .. ")") or ""), "WarmspecNextEditText" } },
      virt_text_pos = "eol",
    })
    shown = { buf = buf, tick = tick, edit = edit, srow = r.start.line, scol = scol, erow = erow, ecol = ecol }
    if N.trace then
      table.insert(N.trace, { kind = "shown", edit = edit, row = r.start.line })
    end
  end), buf)
end

-- Jump to the suggested edit and apply it. Returns false when none is shown (or it went stale).
function N.apply()
  local s = shown
  if not s or api.nvim_get_current_buf() ~= s.buf or api.nvim_buf_get_changedtick(s.buf) ~= s.tick then
    N.clear()
    return false
  end
  N.clear()
  local lines = vim.split(s.edit.text, "\n", { plain = true })
  api.nvim_buf_set_text(s.buf, s.srow, s.scol, s.erow, s.ecol, lines)
  local row = s.srow + #lines - 1
  local col = (#lines == 1 and s.scol or 0) + #lines[#lines]
  api.nvim_win_set_cursor(0, { row + 1, math.max(0, col - 1) })
  if N.trace then
    table.insert(N.trace, { kind = "applied", edit = s.edit, row = s.srow })
  end
  N.request() -- the one after
  return true
end

local function later(args)
  if shown and api.nvim_buf_get_changedtick(shown.buf) ~= shown.tick then
    N.clear() -- stale; a fresh one (after N.apply) stays
  end
  if not timer then
    timer = vim.loop.new_timer()
  end
  timer:stop()
  timer:start(opts.delay_ms, 0, vim.schedule_wrap(core.guard(function()
    if api.nvim_get_mode().mode:sub(1, 1) ~= "i" then
      N.request()
    end
  end)))
end

function N.setup(group, next_edit)
  opts = next_edit
  api.nvim_set_hl(0, "WarmspecNextEdit", { link = "DiffDelete", default = true })
  api.nvim_set_hl(0, "WarmspecNextEditText", { link = "DiffAdd", default = true })
  if not next_edit.enabled then
    return
  end
  local function when_attached(fn)
    return function(args)
      if core.attached(args.buf) then
        core.guard(fn)()
      end
    end
  end
  api.nvim_create_autocmd({ "InsertLeave", "TextChanged" }, { group = group, callback = when_attached(later) })
  api.nvim_create_autocmd("TextChangedI", { group = group, callback = function()
    if shown and api.nvim_buf_get_changedtick(shown.buf) ~= shown.tick then
      N.clear()
    end
  end })
  if next_edit.key then
    local fallback = api.nvim_replace_termcodes(next_edit.key, true, false, true)
    vim.keymap.set({ "n", "i" }, next_edit.key, function()
      local ok, done = pcall(N.apply)
      if not ok then
        core.error(tostring(done))
      elseif not done then
        api.nvim_feedkeys(fallback, "n", false)
      end
    end, { desc = "warmspec: jump to the next edit and apply it" })
  end
end

return N
