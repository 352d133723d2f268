-- :WarmspecAsk streams a `warmspec/chat` answer into a scratch buffer; :WarmspecStatus shows what
-- the daemon is doing.

local core = require("warmspec")
local api = vim.api

local A = {}

-- The latest answer, for scripts and tests: { buf, id, question, text, deltas, result, error, done }.
A.last = nil

local count = 0

local function scratch(question)
  count = count + 1
  vim.cmd(core.config.ask.split)
  local buf = api.nvim_get_current_buf()
  vim.bo[buf].buftype = "nofile"
  vim.bo[buf].bufhidden = "wipe"
  vim.bo[buf].swapfile = false
  vim.bo[buf].filetype = "markdown"
  pcall(api.nvim_buf_set_name, buf, ("warmspec://ask/%d"):format(count))
  api.nvim_buf_set_lines(buf, 0, -1, false, { "> " .. question:gsub("\n", " "), "", "" })
  return buf
end

-- Append text (which may hold newlines) at the end of buf, following it in windows that were at
-- the end already.
local function append(buf, text)
  if not api.nvim_buf_is_valid(buf) then
    return
  end
  local last = api.nvim_buf_line_count(buf) - 1
  local tail = api.nvim_buf_get_lines(buf, last, last + 1, false)[1] or ""
  local followers = {}
  for _, win in ipairs(vim.fn.win_findbuf(buf)) do
    if api.nvim_win_get_cursor(win)[1] - 1 >= last then
      table.insert(followers, win)
    end
  end
  api.nvim_buf_set_text(buf, last, #tail, last, #tail, vim.split(text, "\n", { plain = true }))
  local lines = api.nvim_buf_line_count(buf)
  for _, win in ipairs(followers) do
    api.nvim_win_set_cursor(win, { lines, 0 })
  end
end

-- "32 tokens, 21.4 tok/s, 1.88 tok/pass (17 passes, 24 drafted, 15 accepted), first token 240 ms"
function A.summary(result)
  local s = result.stats or {}
  local parts = { ("%d tokens"):format(s.completion_tokens or 0), ("%.1f tok/s"):format(result.tok_s or 0) }
  if (s.passes or 0) > 0 then
    table.insert(parts, ("%.2f tok/pass (%d passes, %d drafted, %d accepted)"):format(
      s.completion_tokens / s.passes, s.passes, s.drafted or 0, s.accepted or 0))
  end
  table.insert(parts, ("first token %.0f ms"):format((result.ttft_s or 0) * 1000))
  return table.concat(parts, ", ") .. " (" .. tostring(result.finish_reason) .. ")"
end

local function messages(question, context)
  local cfg = core.config.ask
  local msgs = {}
  if cfg.system then
    table.insert(msgs, { role = "system", content = cfg.system })
  end
  local content = question
  if context then
    content = ("Here is %s:\n```%s\n%s\n```\n\n%s"):format(context.name, context.filetype, context.text, question)
  end
  table.insert(msgs, { role = "user", content = content })
  return msgs
end

-- context: { name, filetype, text } of the selected lines to ask about, or nil.
function A.ask(question, context)
  question = vim.trim(question or "")
  if question == "" then
    core.error("usage: :WarmspecAsk {question} (with a range: about those lines)")
    return
  end
  if not core.client() then
    return -- could not start the server; that was reported
  end
  local cfg = core.config.ask
  local buf = scratch(question)
  local answer = { buf = buf, question = question, text = "", deltas = 0, done = false }
  A.last = answer
  local params = { messages = messages(question, context), max_tokens = cfg.max_tokens, temperature = cfg.temperature }
  append(buf, "(waiting for the server...)")
  core.with_client(function(client)
    local function clear_waiting()
      if answer.deltas == 0 and api.nvim_buf_is_valid(buf) then
        api.nvim_buf_set_lines(buf, -2, -1, false, { "" })
      end
    end
    answer.id = core.stream(client, "warmspec/chat", params, core.guard(function(delta)
      clear_waiting()
      answer.deltas = answer.deltas + 1
      answer.text = answer.text .. delta.text
      append(buf, delta.text)
    end), core.guard(function(err, result)
      clear_waiting()
      answer.done = true
      if err then
        answer.error = err.message or tostring(err)
        local cancelled = err.code == -32800
        append(buf, "\n\n-- " .. (cancelled and "cancelled" or ("error: " .. answer.error)))
        if not cancelled then
          core.error("ask: " .. answer.error)
        end
        return
      end
      answer.result = result
      append(buf, "\n\n-- " .. A.summary(result))
    end))
    if answer.id and api.nvim_buf_is_valid(buf) then
      -- Closing the answer, or <C-c> in it, stops the decoding in the daemon.
      local function cancel()
        if not answer.done then
          core.cancel(client, answer.id)
        end
      end
      vim.keymap.set("n", "<C-c>", cancel, { buffer = buf, desc = "warmspec: stop this answer" })
      api.nvim_create_autocmd("BufWipeout", { buffer = buf, once = true, callback = cancel })
    end
  end)
  if api.nvim_buf_is_valid(buf) then
    vim.keymap.set("n", "q", "<Cmd>close<CR>", { buffer = buf, desc = "close" })
  end
  return answer
end

-- -- status ---------------------------------------------------------------------------------------

function A.format_status(s)
  local m = s.model or {}
  local t = s.totals or {}
  local lines = {
    ("%s on %s%s, up %.0f s, %s"):format(m.id or "?", m.device or "?", m.quantized and " (quantized)" or "",
      s.uptime_s or 0, s.blas or ""),
    ("requests: %d done, %d failed, %d queued%s"):format(s.requests_completed or 0, s.requests_failed or 0,
      s.queue or 0, s.active and ", one running" or ""),
  }
  if (t.completion_tokens or 0) > 0 then
    local line = ("totals: %d tokens generated"):format(t.completion_tokens)
    if (t.passes or 0) > 0 then
      line = line .. (", %.2f tok/pass, %d of %d drafted accepted"):format(t.completion_tokens / t.passes,
        t.accepted or 0, t.drafted or 0)
    end
    table.insert(lines, line)
  end
  local g = s.inline
  if g and (g.requests or 0) > 0 then
    local a = g.acceptance or {}
    table.insert(lines, ("ghost text: %d requests (%d cancelled), first visible %.0f ms, final %.0f ms "
      .. "(medians); %d of %d shown accepted, %d in part"):format(g.requests, g.cancelled or 0,
      g.first_visible.p50_ms or 0, g.final.p50_ms or 0, a.accepted or 0, a.shown or 0, a.partial or 0))
  end
  table.insert(lines, ("workspace: %d files indexed"):format(s.workspace_files or 0))
  return lines
end

A.last_status = nil

function A.status()
  if not core.client(false) then
    core.notify("the server is not running (it starts with the first file buffer, or :WarmspecStart)")
    return
  end
  if not core.ready() then
    core.notify("the server is starting (loading the model)")
  end
  core.with_client(function(client)
    core.request(client, "warmspec/status", vim.empty_dict(), core.guard(function(err, result)
      if err then
        core.error("status: " .. tostring(err.message))
        return
      end
      A.last_status = result
      core.notify(table.concat(A.format_status(result), "\n"))
    end))
  end)
end

return A
