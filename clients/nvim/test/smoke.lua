-- End-to-end check of the plugin in a headless Neovim against a real `warmspec lsp`, driven like a
-- user: type in insert mode until ghost text appears, accept it with <Tab>; watch a suggestion grow
-- as it streams; type over one still decoding (which cancels it); accept the next word of one;
-- cycle to an alternative; rename a function at one call site and let next-edit do the others; ask
-- a question, show the status, stop an answer half-way. Run by tests/test_clients_nvim.py:
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
  vim.cmd("filetype on") -- detection only (-u NONE has none): buffers get their languageId
  local warmspec = require("warmspec")
  local ghost = require("warmspec.ghost")
  local nextedit = require("warmspec.nextedit")
  local ask = require("warmspec.ask")
  ghost.trace, nextedit.trace = {}, {} -- record what was shown
  -- Not adaptive: the suggestion length stays put, so a suggestion has room to grow in steps.
  warmspec.setup({
    cmd = vim.fn.json_decode(os.getenv("WARMSPEC_TEST_CMD")),
    inline = { debounce_ms = 50, max_tokens = 24, adaptive = false },
    next_edit = { delay_ms = 50 },
    ask = { max_tokens = 24, temperature = 0 },
  })
  local keys = function(k)
    return api.nvim_replace_termcodes(k, true, false, true)
  end
  -- Type `typed` in insert mode, then for each stage: once `ready()` holds (or after 45 s),
  -- `after()` runs and the keys it returns are fed; the last stage's keys must leave insert mode.
  -- Typing blocks until then, so a timer does the checking.
  local function type_stages(typed, stages)
    local t = vim.loop.new_timer()
    local i = 1
    local deadline = vim.loop.now() + 45000
    t:start(50, 50, vim.schedule_wrap(function()
      local stage = stages[i]
      if not stage then
        return -- a tick scheduled before the last stage stopped the timer
      end
      if not stage.ready() and vim.loop.now() < deadline then
        return
      end
      i = i + 1
      if i > #stages then
        t:stop()
      end
      deadline = vim.loop.now() + 45000
      api.nvim_feedkeys(keys(stage.after()), "t", false)
    end))
    api.nvim_feedkeys(typed, "xt!", false)
  end
  local function type_until(typed, ready, after)
    type_stages(typed, { { ready = ready, after = after } })
  end
  local function status_now()
    local got = nil
    warmspec.request(warmspec.client(false), "warmspec/status", vim.empty_dict(), function(_, result)
      got = result
    end)
    vim.wait(10000, function() return got ~= nil end, 20)
    return got
  end
  local function final_ghost()
    local g = ghost.current()
    return g ~= nil and g.final
  end
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
    if not (g and g.final) and vim.loop.now() < deadline then
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

  -- 2b. Streaming: a new function body; the suggestion grows in steps, then the final one shows.
  local mark0 = #ghost.trace
  type_until(keys("Go<CR>def factorial(n):<CR>    "), final_ghost, function()
    local g = ghost.current()
    local seen = {}
    for i = mark0 + 1, #ghost.trace do
      local e = ghost.trace[i]
      if g and e.id == g.id and e.kind ~= "request" then
        table.insert(seen, { kind = e.kind, text = e.text })
      end
    end
    out.stream = { renders = seen, final = g and g.text }
    return "<Esc>"
  end)

  -- 2c. A keystroke while a suggestion still decodes: typed at its first partial, it cancels the
  -- request on the server (its status counts it) -- the plugin sends $/cancelRequest at once.
  local cancel_at = nil
  out.cancelled_before = status_now().inline.cancelled
  ghost.on_partial_hook = function()
    if not cancel_at then
      cancel_at = vim.loop.now()
      ghost.on_partial_hook = nil
      api.nvim_feedkeys("#", "t", false)
    end
  end
  type_until(keys("Go<CR>def fibonacci_table(limit):<CR>    "), function()
    return cancel_at ~= nil and vim.loop.now() - cancel_at > 300
  end, function()
    out.cancel_typed = cancel_at ~= nil
    return "<Esc>"
  end)
  ghost.on_partial_hook = nil
  out.cancelled_after = status_now().inline.cancelled

  -- 2d. Partial accept: <M-Right> inserts the next word of the suggestion, which keeps showing the
  -- rest; <Tab> then inserts the rest. Each stage waits for its key to have changed the buffer (on
  -- a loaded machine a fed key can take longer than a timer tick to be read).
  out.partial = {}
  local function text_now()
    return table.concat(api.nvim_buf_get_lines(buf, 0, -1, false), "\n")
  end
  local function changed_from(field)
    return function()
      return text_now() ~= out.partial[field]
    end
  end
  type_stages(keys("Go<CR>def is_even(n):<CR>    return "), {
    { ready = final_ghost, after = function()
      local g = ghost.current()
      out.partial.ghost = g and g.text
      out.partial.before = text_now()
      return "<M-Right>"
    end },
    { ready = changed_from("before"), after = function()
      local g = ghost.current()
      out.partial.after_word = text_now()
      out.partial.rest = g and g.text
      return "<Tab>"
    end },
    { ready = changed_from("after_word"), after = function()
      out.partial.after_tab = text_now()
      return "<Esc>"
    end },
  })

  -- 2e. Alternatives: <M-]> asks for them and shows another suggestion.
  out.alternatives = {}
  type_stages(keys("Go<CR>def square(x):<CR>    return "), {
    { ready = final_ghost, after = function()
      out.alternatives.first = ghost.current().text
      return "<M-]>"
    end },
    { ready = function()
      local g = ghost.current()
      return g ~= nil and g.index > 0
    end, after = function()
      local g = ghost.current()
      out.alternatives.shown = g and g.text
      out.alternatives.index = g and g.index
      return "<Esc>"
    end },
  })

  -- 2f. Next edit: rename a function at the first of its three call sites (cw in normal mode);
  -- the next edit marks another call site, <M-n> applies it and the one after is marked.
  local rows = vim.fn.fnamemodify(os.getenv("WARMSPEC_TEST_FILE"), ":h") .. "/rows.py"
  vim.fn.writefile({ "def fetch_rows(db, table):", "    return db.query(table)", "", "",
                     'users = fetch_rows(db, "users")', 'orders = fetch_rows(db, "orders")',
                     'items = fetch_rows(db, "items")' }, rows)
  vim.cmd("edit " .. vim.fn.fnameescape(rows))
  local rbuf = api.nvim_get_current_buf()
  vim.wait(10000, function() return warmspec.attached(rbuf) ~= nil end, 20)
  api.nvim_win_set_cursor(0, { 5, 8 })
  api.nvim_feedkeys(keys("cwload_rows<Esc>"), "xt", false)
  local function marked(n)
    return function()
      return #vim.tbl_filter(function(e) return e.kind == "shown" end, nextedit.trace) >= n
    end
  end
  out.next_edit = { first = vim.wait(15000, marked(1), 20) }
  api.nvim_feedkeys(keys("<M-n>"), "xt", false)
  out.next_edit.second = vim.wait(15000, marked(2), 20)
  api.nvim_feedkeys(keys("<M-n>"), "xt", false)
  vim.wait(15000, marked(3), 20)
  out.next_edit.trace = {}
  for _, e in ipairs(nextedit.trace) do
    table.insert(out.next_edit.trace, { kind = e.kind, row = e.row, text = e.edit.text, old = e.edit.old,
                                        kind_of_edit = e.edit.kind })
  end
  out.next_edit.lines = api.nvim_buf_get_lines(rbuf, 0, -1, false)
  vim.cmd("buffer " .. buf)
  mark("features")

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
  out.status = ask.last_status and { model = ask.last_status.model.id, completed = ask.last_status.requests_completed,
                                     inline = ask.last_status.inline }

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
