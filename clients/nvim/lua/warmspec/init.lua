-- warmspec for Neovim: one `warmspec lsp` child per Neovim, run by the built-in LSP client.
--
-- The built-in client does the framing, document sync (full text) and request bookkeeping; this
-- module adds what it does not know: warmspec's own methods and the `warmspec/delta` stream,
-- ghost-text inline completion, streamed as it decodes (ghost.lua), next-edit suggestions
-- (nextedit.lua) and the :WarmspecAsk / :WarmspecStatus commands (ask.lua). Works on Neovim 0.7 and later (0.7: vim.lsp.start_client, no vim.lsp.start).

local M = {}

M.defaults = {
  cmd = { "warmspec", "lsp" }, -- the server; e.g. { "warmspec", "lsp", "--model", "..." }
  -- Where the server runs (its default workspace root); files under it can be drafted from.
  root_dir = function()
    local git = vim.fn.finddir(".git", vim.fn.getcwd() .. ";")
    return git ~= "" and vim.fn.fnamemodify(git, ":p:h:h") or vim.fn.getcwd()
  end,
  filetypes = nil, -- nil: every file buffer; or a list such as { "python", "lua" }
  autostart = true, -- attach file buffers as they are opened (false: only on :WarmspecStart)
  inline = {
    enabled = true,
    debounce_ms = 150, -- idle time in insert mode before asking for ghost text
    prefetch = true, -- the server starts the suggestion at each typed change, before it is asked
    adaptive = true, -- debounce: the server's advice, and at least 1.2x the user's pause between keys
    debounce_min_ms = 30,
    debounce_max_ms = 600,
    deadline_ms = nil, -- time budget of a suggestion (the server answers with what it has by then)
    accept_key = "<Tab>", -- insert-mode key that accepts the ghost text (false: no mapping)
    accept_word_key = "<M-Right>", -- accepts its next word
    accept_line_key = "<M-Down>", -- accepts its next line
    cycle_key = "<M-]>", -- shows another suggestion (warmspec/alternatives)
    alternatives = 3, -- how many to ask for
    trigger_key = false, -- insert-mode key that asks now, e.g. "<M-\\>"
    max_tokens = 48, -- longest suggestion (the server's limit is 512; it adapts below it)
    prefix_chars = 4096, -- how much text before the cursor the model sees
    suffix_chars = 1024,
  },
  next_edit = {
    enabled = true,
    key = "<M-n>", -- normal and insert mode: jump to the suggested next edit and apply it
    delay_ms = 200, -- after an edit, before asking
  },
  ask = {
    max_tokens = 512,
    temperature = nil, -- nil: the model's default
    system = nil, -- a system prompt
    split = "botright new", -- how the answer window opens
  },
}

M.config = vim.deepcopy(M.defaults)

-- The client and what waits on it. `streams` maps a request id to its delta callback.
local state = { client_id = nil, ready = false, waiting = {}, streams = {}, stopping = false }

local function has(version)
  return vim.fn.has("nvim-" .. version) == 1
end

-- Messages are shown from the main loop: an error message inside an autocommand or a command
-- run from Lua would otherwise become an exception that aborts the other autocommands (and it
-- cannot be shown at all from a libuv callback).
function M.notify(msg, level)
  vim.schedule(function()
    vim.notify("warmspec: " .. msg, level or vim.log.levels.INFO)
  end)
end

function M.error(msg)
  M.notify(msg, vim.log.levels.ERROR)
end

-- A callback that reports its own errors instead of raising them in a handler, where they would
-- interrupt whatever the user is doing.
function M.guard(fn)
  return function(...)
    local ok, err = pcall(fn, ...)
    if not ok then
      M.error(tostring(err))
    end
  end
end

-- -- the client ---------------------------------------------------------------------------------

local function on_partial(_, params)
  if params then
    require("warmspec.ghost").on_partial(params)
  end
end

local function on_delta(_, params)
  local stream = params and state.streams[params.id]
  if stream then
    stream(params)
  end
end

local function flush_waiting(client)
  local waiting = state.waiting
  state.waiting = {}
  for _, fn in ipairs(waiting) do
    M.guard(fn)(client)
  end
end

-- 0.11 deprecates vim.lsp.start_client for vim.lsp.start{attach = false}, which 0.10 lacks.
local function start_client(config)
  if has("0.11") then
    return vim.lsp.start(config, { attach = false, reuse_client = function() return false end })
  end
  return vim.lsp.start_client(config)
end

-- Attach the file buffers already open (a new server after a restart or a crash).
local function attach_open_buffers(client_id)
  if not M.config.autostart then
    return
  end
  for _, buf in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(buf) and M.wanted(buf) and not vim.lsp.buf_is_attached(buf, client_id) then
      vim.lsp.buf_attach_client(buf, client_id)
    end
  end
end

-- The server's last "warmspec: ..." line on stderr (its error message when it fails), which
-- Neovim's LSP client only writes to its log.
local function last_server_error()
  local ok, lines = pcall(vim.fn.readfile, vim.lsp.get_log_path(), "", -200)
  if not ok then
    return nil
  end
  for i = #lines, 1, -1 do
    local msg = lines[i]:match('"stderr"%s+"(warmspec: .*)"%s*$')
    if msg then
      return (msg:gsub("\\n.*$", "")) -- up to the first (escaped) newline
    end
  end
  return nil
end

local function start()
  local cfg = M.config
  local exe = cfg.cmd[1]
  if vim.fn.executable(exe) ~= 1 then
    M.error(("cannot start the server: %q is not an executable (set cmd in require('warmspec').setup{})"):format(exe))
    return nil
  end
  local root = cfg.root_dir()
  state.stopping = false
  local ok, id = pcall(start_client, {
    name = "warmspec",
    cmd = cfg.cmd,
    cmd_cwd = root,
    root_dir = root,
    init_options = {
      inlineCompletion = {
        maxTokens = cfg.inline.max_tokens,
        prefixChars = cfg.inline.prefix_chars,
        suffixChars = cfg.inline.suffix_chars,
        stream = true,
        debounceMs = cfg.inline.debounce_ms,
        adapt = cfg.inline.adaptive,
        prefetch = cfg.inline.prefetch,
      },
    },
    handlers = { ["warmspec/delta"] = on_delta, ["warmspec/inlineCompletionPartial"] = on_partial },
    flags = { debounce_text_changes = 100 },
    on_init = function(client)
      state.ready = true
      vim.schedule(function()
        flush_waiting(client)
      end)
    end,
    on_exit = function(code, signal, client_id)
      if client_id ~= state.client_id then
        return -- a client stopped by a restart, after its successor started
      end
      local was_ready = state.ready
      state.client_id, state.ready = nil, false
      local streams, waiting = state.streams, state.waiting
      state.streams, state.waiting = {}, {}
      vim.schedule(function()
        if not state.stopping then
          -- A moment later: the server's last words on stderr can arrive after its exit.
          vim.defer_fn(function()
            local why = signal ~= 0 and ("signal " .. signal) or ("code " .. code)
            local said = code ~= 0 and last_server_error()
            M.error(("the server exited (%s)%s%s; its log is in %s"):format(why,
              was_ready and "" or " before it was ready", said and (": " .. said:gsub("^warmspec: ", "")) or "",
              vim.lsp.get_log_path()))
          end, 200)
        end
        for _, stream in pairs(streams) do
          stream(nil, { code = -32603, message = "the server exited" })
        end
        if #waiting > 0 and not state.stopping then
          M.error(("%d request(s) dropped"):format(#waiting))
        end
      end)
    end,
  })
  if not ok or not id then
    M.error("cannot start the server: " .. tostring(id))
    return nil
  end
  state.client_id = id
  attach_open_buffers(id)
  return id
end

-- The client object, started when needed (nil when it cannot be started).
function M.client(start_if_needed)
  local client = state.client_id and vim.lsp.get_client_by_id(state.client_id)
  if not client and start_if_needed ~= false then
    local id = start()
    client = id and vim.lsp.get_client_by_id(id)
  end
  return client
end

-- Run fn(client) once the server has answered `initialize` (the model loads first: seconds).
function M.with_client(fn)
  local client = M.client()
  if not client then
    return
  end
  if state.ready then
    M.guard(fn)(client)
  else
    table.insert(state.waiting, fn)
  end
end

function M.ready()
  return state.ready and M.client(false) ~= nil
end

-- A request on the client (0.11 made these methods; the dot form is deprecated there).
-- Returns the request id, or nil when it could not be sent.
function M.request(client, method, params, handler, bufnr)
  local ok, id
  if has("0.11") then
    ok, id = client:request(method, params, handler, bufnr)
  else
    ok, id = client.request(method, params, handler, bufnr)
  end
  if not ok then
    M.error("could not send " .. method .. ": the server is not running")
    return nil
  end
  return id
end

-- Cancel a request. Neovim drops the server's RequestCancelled reply without calling the
-- handler, so a stream is ended here.
function M.cancel(client, id)
  if has("0.11") then
    client:cancel_request(id)
  else
    client.cancel_request(id)
  end
  local stream = state.streams[id]
  if stream then
    stream(nil, { code = -32800, message = "cancelled" })
  end
end

-- Start a streaming request: on_delta(params) for each `warmspec/delta`, then handler(err, result).
function M.stream(client, method, params, on_delta_fn, handler)
  local id
  id = M.request(client, method, params, function(err, result)
    state.streams[id] = nil
    handler(err, result)
  end)
  if id then
    -- Registered before Neovim reads the next message: no delta can arrive in between.
    state.streams[id] = function(delta, failure)
      if failure then
        state.streams[id] = nil
        handler(failure, nil)
      else
        on_delta_fn(delta)
      end
    end
  end
  return id
end

-- Whether a buffer is one the server should see (a named, normal file buffer).
function M.wanted(buf)
  if vim.bo[buf].buftype ~= "" or vim.api.nvim_buf_get_name(buf) == "" then
    return false
  end
  local fts = M.config.filetypes
  return fts == nil or vim.tbl_contains(fts, vim.bo[buf].filetype)
end

function M.attach(buf)
  buf = (buf == nil or buf == 0) and vim.api.nvim_get_current_buf() or buf
  local client = M.client()
  if client and not vim.lsp.buf_is_attached(buf, client.id) then
    vim.lsp.buf_attach_client(buf, client.id)
  end
  return client
end

-- The client, when it is ready and attached to buf.
function M.attached(buf)
  local client = M.client(false)
  if client and state.ready and vim.lsp.buf_is_attached(buf, client.id) then
    return client
  end
  return nil
end

-- Start the server (if needed) and attach the current buffer when it is a file buffer.
function M.start()
  local buf = vim.api.nvim_get_current_buf()
  if M.wanted(buf) then
    M.attach(buf)
  else
    M.client()
  end
end

function M.stop()
  local client = M.client(false)
  if client then
    state.stopping = true
    if has("0.11") then
      client:stop()
    else
      client.stop()
    end
  end
end

function M.restart()
  M.stop()
  -- stop() is asynchronous: wait until the old client is gone before starting another.
  vim.wait(3000, function()
    return state.client_id == nil
  end, 20)
  M.start()
end

-- -- commands and setup -------------------------------------------------------------------------

function M.ask(question, context)
  require("warmspec.ask").ask(question, context)
end

function M.status()
  require("warmspec.ask").status()
end

function M.complete()
  require("warmspec.ghost").request({ manual = true })
end

function M.accept()
  return require("warmspec.ghost").accept()
end

function M.dismiss()
  require("warmspec.ghost").dismiss()
end

function M.accept_word()
  return require("warmspec.ghost").accept_word()
end

function M.accept_line()
  return require("warmspec.ghost").accept_line()
end

function M.cycle()
  return require("warmspec.ghost").cycle()
end

function M.next_edit()
  return require("warmspec.nextedit").apply()
end

function M.setup(opts)
  M.config = vim.tbl_deep_extend("force", vim.deepcopy(M.defaults), opts or {})
  local group = vim.api.nvim_create_augroup("warmspec", { clear = true })
  if M.config.autostart then
    vim.api.nvim_create_autocmd({ "BufReadPost", "BufNewFile", "FileType" }, {
      group = group,
      callback = function(args)
        if M.wanted(args.buf) then
          M.guard(M.attach)(args.buf)
        end
      end,
    })
    if M.wanted(vim.api.nvim_get_current_buf()) then -- setup{} after the first file was opened
      M.guard(M.attach)(vim.api.nvim_get_current_buf())
    end
  end
  require("warmspec.ghost").setup(group, M.config.inline)
  require("warmspec.nextedit").setup(group, M.config.next_edit)
end

return M
