-- End-to-end check of the plugin in a headless Neovim against a real `warmspec lsp`, driven like a
-- user: type in insert mode until ghost text appears, accept it with <Tab>, ask a question, show
-- the status, stop an answer half-way. Run by tests/test_clients_nvim.py:
--
--   nvim --headless -u NONE --cmd "set rtp^=clients/nvim" -c "luafile clients/nvim/test/smoke.lua"
--
-- Environment: WARMSPEC_TEST_CMD (the server command, JSON), WARMSPEC_TEST_FILE (a Python file to
-- edit), WARMSPEC_TEST_OUT (where the JSON results go). Every step records what it saw; the
-- Python side asserts, so a failure shows everything at once.

local api = vim.api
local out = { steps = {}, times = {} }
local t0 = vim.loop.hrtime()

local function mark(step)
  out.times[step] = (vim.loop.hrtime() - t0) / 1e9
end

local function finish()
  out.messages = vim.fn.execute("messages")
  vim.fn.writefile({ vim.fn.json_encode(out) }, os.getenv("WARMSPEC_TEST_OUT"))
  vim.cmd("qa!")
end

local function fail(msg)
  out.failure = msg
  finish()
end

local ok_run, run_err = pcall(function()
  vim.cmd("runtime plugin/warmspec.lua")
  local warmspec = require("warmspec")
  local ghost = require("warmspec.ghost")
  local ask = require("warmspec.ask")
  warmspec.setup({
    cmd = vim.fn.json_decode(os.getenv("WARMSPEC_TEST_CMD")),
    inline = { debounce_ms = 50, max_tokens = 12 },
    ask = { max_tokens = 24, temperature = 0 },
  })
  out.version = vim.version()

  -- 1. The server starts with the first file buffer.
  vim.cmd("edit " .. vim.fn.fnameescape(os.getenv("WARMSPEC_TEST_FILE")))
  local buf = api.nvim_get_current_buf()
  out.steps.ready = vim.wait(90000, warmspec.ready, 50)
  if not out.steps.ready then
    return fail("the server did not initialize within 90 s")
  end
  mark("ready")
  out.steps.attached = warmspec.attached(buf) ~= nil

  -- 2. Ghost text: type at the end of the file; after the idle delay the suggestion shows as an
  -- extmark. The insert-mode typing below blocks until <Esc>, so a timer does the checking.
  local poll = vim.loop.new_timer()
  local deadline = vim.loop.now() + 45000
  poll:start(100, 100, vim.schedule_wrap(function()
    local g = ghost.current()
    if not g and vim.loop.now() < deadline then
      return
    end
    poll:stop()
    if g then
      local marks = api.nvim_buf_get_extmarks(buf, ghost.namespace, 0, -1, { details = true })
      local shown = {}
      for _, mark in ipairs(marks) do
        for _, chunk in ipairs(mark[4].virt_text or {}) do
          table.insert(shown, chunk[1])
        end
        for _, line in ipairs(mark[4].virt_lines or {}) do
          table.insert(shown, "\n" .. line[1][1])
        end
      end
      out.ghost = { text = g.text, row = g.row, col = g.col, extmarks = #marks, virt_text = table.concat(shown),
                    mode = api.nvim_get_mode().mode }
      out.line_before_accept = api.nvim_get_current_line()
    end
    -- <Tab> goes through the plugin's mapping ("t": as if typed); then leave insert mode.
    api.nvim_feedkeys(api.nvim_replace_termcodes("<Tab><Esc>", true, false, true), "t", false)
  end))
  vim.bo[buf].autoindent = false
  api.nvim_feedkeys("Go    return fib", "xt!", false) -- returns when the timer's <Esc> arrives
  mark("ghost")
  out.lines_after_accept = api.nvim_buf_get_lines(buf, 0, -1, false)
  out.ghost_after_accept = ghost.visible()
  out.extmarks_after_accept = #api.nvim_buf_get_extmarks(buf, ghost.namespace, 0, -1, {})

  -- 3. :WarmspecAsk streams into a scratch buffer and ends with the summary line.
  vim.cmd("WarmspecAsk Say hello in one short sentence.")
  local answer = ask.last
  vim.wait(60000, function()
    return answer.done
  end, 50)
  mark("ask")
  out.ask = {
    done = answer.done, deltas = answer.deltas, text = answer.text, error = answer.error,
    result_text = answer.result and answer.result.text, finish_reason = answer.result and answer.result.finish_reason,
    buffer = api.nvim_buf_is_valid(answer.buf) and api.nvim_buf_get_lines(answer.buf, 0, -1, false) or nil,
    buftype = api.nvim_buf_is_valid(answer.buf) and vim.bo[answer.buf].buftype or nil,
  }

  -- 4. :WarmspecStatus.
  vim.cmd("WarmspecStatus")
  vim.wait(10000, function()
    return ask.last_status ~= nil
  end, 50)
  mark("status")
  out.status = ask.last_status and { model = ask.last_status.model.id, completed = ask.last_status.requests_completed }

  -- 5. Closing an answer while it streams stops it in the daemon.
  warmspec.config.ask.max_tokens = 400
  vim.cmd("WarmspecAsk Count from one to one hundred, one number per line.")
  local long = ask.last
  vim.wait(30000, function()
    return long.deltas > 0 or long.done
  end, 20)
  vim.cmd("bwipeout! " .. long.buf)
  vim.wait(15000, function()
    return long.done
  end, 20)
  mark("cancel")
  out.cancel = { done = long.done, deltas = long.deltas, error = long.error, result = long.result ~= nil }
  finish()
end)

if not ok_run then
  fail("error in the test script: " .. tostring(run_err))
end
