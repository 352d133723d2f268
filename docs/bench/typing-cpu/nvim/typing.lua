-- A typing session in a real headless Neovim with the warmspec plugin as shipped (its defaults,
-- `warmspec lsp` as the server): type a span of a file key by key at the replay's pace, and
-- record when each ghost-text request went out and when its first non-blank character and its
-- final suggestion were shown. Driven by run.py (which writes the schedule and reads the result):
--
--   nvim --headless -u NONE --cmd "set rtp^=clients/nvim" -c "luafile docs/bench/typing-cpu/nvim/typing.lua"
--
-- Environment: WARMSPEC_TYPING (the schedule, JSON: file, line, col, keys = { {text, gap_ms} }),
-- WARMSPEC_TYPING_OUT (the result, JSON), WARMSPEC_TEST_CMD (the server command, JSON),
-- WARMSPEC_PREFETCH ("0": the plugin's prefetch off). Nothing is accepted: the suggestions are
-- only watched, so every side types the same keys.

local api = vim.api
local plan = vim.fn.json_decode(table.concat(vim.fn.readfile(os.getenv("WARMSPEC_TYPING")), "\n"))
local out = { failure = nil }

local function finish()
  vim.fn.writefile({ vim.fn.json_encode(out) }, os.getenv("WARMSPEC_TYPING_OUT"))
  vim.cmd("qa!")
end

local ok_run, err = pcall(function()
  vim.cmd("runtime plugin/warmspec.lua")
  vim.cmd("filetype on")
  local warmspec = require("warmspec")
  local ghost = require("warmspec.ghost")
  warmspec.setup({
    cmd = vim.fn.json_decode(os.getenv("WARMSPEC_TEST_CMD")),
    inline = { prefetch = os.getenv("WARMSPEC_PREFETCH") ~= "0" },
  })
  vim.cmd("edit " .. vim.fn.fnameescape(plan.file))
  -- A line break and the indentation after it come as one key (the schedule's): the editor's own
  -- indenting is off, so the text typed is the file's.
  vim.bo.autoindent, vim.bo.smartindent, vim.bo.cindent, vim.bo.indentexpr = false, false, false, ""
  local buf = api.nvim_get_current_buf()
  if not vim.wait(120000, function() return warmspec.ready() and warmspec.attached(buf) ~= nil end, 50) then
    out.failure = "the server did not attach"
    return finish()
  end
  -- Warm-up, not counted: one suggestion at the start of the span (the model's first prefill).
  -- The script returns first, so that Neovim's main loop enters insert mode; timers do the rest.
  api.nvim_win_set_cursor(0, { plan.line, plan.col })
  api.nvim_feedkeys("i", "nt", false)
  local i = 0
  local function next_key()
    i = i + 1
    local k = plan.keys[i]
    if not k then
      vim.defer_fn(function()
        out.trace = ghost.trace
        out.ended = vim.loop.hrtime() / 1e6
        out.lines = api.nvim_buf_get_lines(buf, 0, -1, false)
        warmspec.request(warmspec.client(false), "warmspec/status", vim.empty_dict(), function(_, result)
          out.status = result and result.inline
          finish()
        end)
      end, 3000) -- the last suggestions arrive
      return
    end
    vim.defer_fn(function()
      api.nvim_feedkeys(k[1], "nt", false) -- literally: no mapping, no termcodes
      next_key()
    end, k[2])
  end
  local waited = 0
  local function warm()
    local g = ghost.current()
    if g ~= nil and g.final then
      ghost.trace = {}
      out.started = vim.loop.hrtime() / 1e6
      return next_key()
    end
    waited = waited + 50
    if waited > 120000 then
      out.failure = "no warm-up suggestion"
      return finish()
    end
    vim.defer_fn(warm, 50)
  end
  vim.defer_fn(function()
    ghost.trace = {}
    ghost.request({ manual = true })
    warm()
  end, 200)
end)
if not ok_run then
  out.failure = tostring(err)
  finish()
end
