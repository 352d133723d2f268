-- Ghost text: after a short idle in insert mode, ask the server for `textDocument/inlineCompletion`
-- at the cursor and show the suggestion as virtual text, growing as the model writes it
-- (`warmspec/inlineCompletionPartial`); <Tab> (configurable) inserts it, <M-Right> its next word,
-- <M-Down> its next line, <M-]> cycles through alternatives; moving the cursor, typing on, or
-- leaving insert mode dismisses it. A keystroke cancels the request still running at once.
--
-- Every suggestion's fate goes back to the server (`warmspec/inlineCompletionFeedback`: shown,
-- accepted, partial, dismissed), which tunes the suggestion length and advises a debounce; the
-- debounce used is the larger of that advice and a little over the user's own pause between
-- keystrokes (no request fires between two keys of a word typed at the user's pace).
--
-- Neovim 0.7 has no inline virtual text (0.10 added virt_text_pos = "inline"): there the first
-- line overlays the (empty) rest of the line at the end of a line, and goes after the line's end
-- when the cursor is mid-line. Later lines are virt_lines (0.6+).

local core = require("warmspec")
local api = vim.api

local G = {}

local ns = api.nvim_create_namespace("warmspec_ghost")
G.namespace = ns

local INVOKED, AUTOMATIC = 1, 2 -- LSP InlineCompletionTriggerKind
local CANCELLED = { [-32800] = true, [-32801] = true } -- RequestCancelled, ContentModified
local FEEDBACK = "warmspec/inlineCompletionFeedback"

local opts = core.defaults.inline
local timer = nil
local pending = nil -- the running request: { client, id, buf, tick, cursor, manual }
-- The suggestion shown: { client, buf, row, col, text (still to insert), start_col, tick, id,
-- index, offset (characters of the item's text before `text`: typed or accepted), final }
local shown = nil
local alternatives = nil -- { buf, tick, row, col, items, at } from warmspec/alternatives
local reported = {} -- error messages already shown (one echo each, not one per keystroke)
local own_tick = nil -- changedtick of the buffer after the plugin's own partial insert
local gaps = {} -- the last pauses between keystrokes, in ms
local last_key = nil
local advised = nil -- the server's advised debounce (ms)

-- What the user saw, for tests and scripts: set G.trace = {} to record { kind = "partial" |
-- "final" | "request", text, id, t } per render and request (t: milliseconds, vim.loop.hrtime()).
-- Off (nil) by default, so an editing session does not keep every partial it was shown.
G.trace = nil

local function record(kind, id, text)
  if G.trace then
    table.insert(G.trace, { kind = kind, text = text, id = id, t = vim.loop.hrtime() / 1e6 })
  end
end

-- Byte column of an LSP `character` on `line` in the client's position encoding.
local function byte_col(line, character, encoding)
  if encoding == "utf-8" then
    return math.min(character, #line)
  end
  local ok, col
  if vim.fn.has("nvim-0.11") == 1 then -- (s, encoding, index, strict); the old form is deprecated
    ok, col = pcall(vim.str_byteindex, line, encoding, character, false)
  else
    ok, col = pcall(vim.str_byteindex, line, character, encoding == "utf-16")
  end
  return ok and col or #line
end
G.byte_col = byte_col

-- Characters (code points) of a string: what the server counts suggestions in.
local function chars(s)
  return (vim.str_utfindex(s))
end

local function feedback(client, id, event, accepted_chars, index)
  if client and id then
    local params = { id = id, event = event, index = index or 0 }
    if accepted_chars then
      params.accepted_chars = accepted_chars
    end
    if vim.fn.has("nvim-0.11") == 1 then
      client:notify(FEEDBACK, params)
    else
      client.notify(FEEDBACK, params)
    end
  end
end

local function cancel_pending()
  if pending then
    pcall(core.cancel, pending.client, pending.id)
    pending = nil
  end
end

local function clear()
  if shown and api.nvim_buf_is_valid(shown.buf) then
    api.nvim_buf_clear_namespace(shown.buf, ns, 0, -1)
  end
  shown = nil
end

-- Hide the suggestion; a final one the user did not take is reported dismissed. `typed`: the text
-- the user typed over it, which counts as accepted where it matches.
function G.dismiss(typed)
  local g = shown
  clear()
  if g and g.final then
    if typed and typed ~= "" and g.text:sub(1, #typed) == typed then
      feedback(g.client, g.id, "partial", g.offset + chars(typed), g.index)
    end
    feedback(g.client, g.id, "dismissed", nil, g.index)
  end
end

function G.visible()
  return shown ~= nil
end

-- The ghost text now shown: { buf, row, col, text, final, id } (row 0-based, col in bytes), or nil.
function G.current()
  return shown
end

local function render(buf, row, col, text)
  api.nvim_buf_clear_namespace(buf, ns, 0, -1)
  local lines = vim.split(text, "\n", { plain = true })
  local line = api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ""
  local mark = { virt_text = { { lines[1], "WarmspecGhost" } }, hl_mode = "combine" }
  if vim.fn.has("nvim-0.10") == 1 then
    mark.virt_text_pos = "inline"
  elseif col >= #line then
    mark.virt_text_pos = "overlay"
  else
    mark.virt_text_pos = "eol"
  end
  if #lines > 1 then
    mark.virt_lines = {}
    for i = 2, #lines do
      table.insert(mark.virt_lines, { { lines[i], "WarmspecGhost" } })
    end
  end
  api.nvim_buf_set_extmark(buf, ns, row, col, mark)
end

-- The text of an InlineCompletionItem that is still to be typed at the cursor, the byte column
-- where the item's text starts (it may replace what was typed since its range's start) and the
-- characters of it already typed.
local function ghost_of(item, line, cursor_col, encoding)
  local text = item.insertText
  if type(text) == "table" then -- a StringValue (snippet): shown and inserted as plain text
    text = text.value
  end
  if type(text) ~= "string" or text == "" then
    return nil
  end
  local start_col = cursor_col
  local range = item.range
  if range and range.start then
    start_col = byte_col(line, range.start.character, encoding)
    if start_col > cursor_col then
      return nil
    end
  end
  local typed = line:sub(start_col + 1, cursor_col)
  if text:sub(1, #typed) ~= typed then
    return nil -- the suggestion does not continue what is there
  end
  local rest = text:sub(#typed + 1)
  return rest ~= "" and rest or nil, start_col, chars(typed)
end

-- Whether the editor is still where request `r` was made.
local function still_there(r)
  return api.nvim_get_current_buf() == r.buf and api.nvim_buf_get_changedtick(r.buf) == r.tick
    and vim.deep_equal(api.nvim_win_get_cursor(0), r.cursor)
    and (r.manual or api.nvim_get_mode().mode:sub(1, 1) == "i")
end

-- Show `item` for request `r` (`final`: its answer; else a partial).
local function show(r, item, final, id, index)
  local row, col = r.cursor[1] - 1, r.cursor[2]
  local line = api.nvim_buf_get_lines(r.buf, row, row + 1, false)[1] or ""
  local text, start_col, typed = ghost_of(item, line, col, r.client.offset_encoding)
  if not text then
    if final then
      clear()
    end
    return
  end
  render(r.buf, row, col, text)
  shown = { client = r.client, buf = r.buf, row = row, col = col, text = text, start_col = start_col,
            tick = r.tick, id = id, index = index or 0, offset = typed, final = final }
  record(final and "final" or "partial", id, text)
  if final then
    feedback(r.client, id, "shown", nil, index)
  end
end

-- `warmspec/inlineCompletionPartial`: the suggestion so far of the running request.
function G.on_partial(params)
  local r = pending
  if not r or params.id ~= r.id or not still_there(r) then
    return
  end
  show(r, { insertText = params.text, range = { start = params.position } }, false, r.id)
  if G.on_partial_hook then
    G.on_partial_hook(params)
  end
end

-- Ask for ghost text at the cursor now. req.manual: asked by the user (also outside insert mode).
function G.request(req)
  req = req or {}
  local buf, win = api.nvim_get_current_buf(), api.nvim_get_current_win()
  local client = core.attached(buf)
  if not client then
    if req.manual then
      core.notify(core.ready() and "this buffer is not attached" or "the server is still starting")
    end
    return
  end
  cancel_pending()
  local params = vim.lsp.util.make_position_params(win, client.offset_encoding)
  params.context = { triggerKind = req.manual and INVOKED or AUTOMATIC }
  if opts.deadline_ms then
    params.warmspec = { deadlineMs = opts.deadline_ms }
  end
  local r = { client = client, buf = buf, tick = api.nvim_buf_get_changedtick(buf),
              cursor = api.nvim_win_get_cursor(win), manual = req.manual }
  local id
  id = core.request(client, "textDocument/inlineCompletion", params, core.guard(function(err, result)
    if pending and pending.id == id then
      pending = nil
    end
    if err then
      if not CANCELLED[err.code] and not reported[err.message] then
        reported[err.message] = true
        core.error("inline completion: " .. tostring(err.message))
      end
      return
    end
    local info = result and result.warmspec
    if info then
      advised = info.debounceMs
      G.last_info = info
    end
    if not still_there(r) then -- the user typed or moved while the model was thinking
      return
    end
    local items = result and (result.items or result) or {}
    if not items[1] then
      clear()
      return
    end
    show(r, items[1], true, id)
  end), buf)
  if id then
    r.id = id
    pending = r
    record("request", id)
  end
end

-- Insert `piece` (the start of the shown text) at the suggestion and keep showing the rest.
local function insert(piece)
  local g = shown
  local lines = vim.split(piece, "\n", { plain = true })
  api.nvim_buf_set_text(g.buf, g.row, g.col, g.row, g.col, lines)
  local row = g.row + #lines - 1
  local col = (#lines == 1 and g.col or 0) + #lines[#lines]
  api.nvim_win_set_cursor(0, { row + 1, col })
  return row, col
end

-- Insert all of the ghost text and put the cursor after it. Returns false when none was shown.
function G.accept()
  local g = shown
  if not g or not api.nvim_buf_is_valid(g.buf) or api.nvim_get_current_buf() ~= g.buf then
    clear()
    return false
  end
  insert(g.text)
  clear()
  if g.final then
    feedback(g.client, g.id, "accepted", nil, g.index)
  end
  return true
end

-- The next word of a suggestion: its leading blanks (a line break included) and then a run of
-- word characters or a run of other non-blank ones.
function G.next_word(text)
  return text:match("^%s*[%w_]+") or text:match("^%s*[^%w_%s]+") or text
end

-- Up to and including the next line break (all of it when there is none).
function G.next_line(text)
  return text:match("^[^\n]*\n") or text
end

-- Accept the start of the suggestion that `pick(text)` returns; the rest stays shown.
local function accept_part(pick)
  local g = shown
  if not g or not api.nvim_buf_is_valid(g.buf) or api.nvim_get_current_buf() ~= g.buf then
    return false
  end
  local piece = pick(g.text)
  if piece == g.text then
    return G.accept()
  end
  local row, col = insert(piece)
  own_tick = api.nvim_buf_get_changedtick(g.buf)
  g.text, g.row, g.col, g.tick = g.text:sub(#piece + 1), row, col, own_tick
  g.offset = g.offset + chars(piece)
  render(g.buf, row, col, g.text)
  if g.final then
    feedback(g.client, g.id, "partial", g.offset, g.index)
  end
  return true
end

function G.accept_word()
  return accept_part(G.next_word)
end

function G.accept_line()
  return accept_part(G.next_line)
end

-- Show the next alternative (`warmspec/alternatives`, asked for on the first press at a place).
function G.cycle()
  local buf, win = api.nvim_get_current_buf(), api.nvim_get_current_win()
  local client = core.attached(buf)
  if not client then
    return false
  end
  local cursor = api.nvim_win_get_cursor(win)
  local r = { client = client, buf = buf, tick = api.nvim_buf_get_changedtick(buf), cursor = cursor, manual = true }
  local a = alternatives
  if a and a.buf == buf and a.tick == r.tick and vim.deep_equal(a.cursor, cursor) then
    a.at = a.at % #a.items + 1
    G.dismiss()
    show(r, { insertText = a.items[a.at].text, range = a.range }, true, a.id, a.at - 1)
    return true
  end
  cancel_pending()
  local params = vim.lsp.util.make_position_params(win, client.offset_encoding)
  params = { uri = params.textDocument.uri, position = params.position, count = opts.alternatives }
  local id
  id = core.request(client, "warmspec/alternatives", params, core.guard(function(err, result)
    if err then
      core.error("alternatives: " .. tostring(err.message))
      return
    end
    if not still_there(r) or not result.items[1] then
      return
    end
    -- The greedy one is what was shown already: start at the next.
    local at = (shown and #result.items > 1) and 2 or 1
    alternatives = { buf = buf, tick = r.tick, cursor = cursor, items = result.items, range = result.range,
                     at = at, id = id }
    G.dismiss()
    show(r, { insertText = result.items[at].text, range = result.range }, true, id, at - 1)
  end), buf)
  return id ~= nil
end

-- How long to wait after a keystroke: the server's advice (or the configured debounce), but at
-- least a little over the user's median pause between keys, within [min, max].
function G.debounce_ms()
  local wait = (opts.adaptive and advised) or opts.debounce_ms
  if opts.adaptive and #gaps >= 4 then
    local sorted = vim.deepcopy(gaps)
    table.sort(sorted)
    wait = math.max(wait, 1.2 * sorted[math.ceil(#sorted / 2)])
  end
  return math.floor(math.min(opts.debounce_max_ms, math.max(opts.debounce_min_ms, wait)))
end

local function on_text_changed(args)
  local tick = api.nvim_buf_get_changedtick(args.buf)
  if own_tick and tick == own_tick then
    return -- the plugin's own insert (a partial accept): the rest is still shown
  end
  own_tick = nil
  local now = vim.loop.now()
  if last_key and now - last_key < 1000 then
    table.insert(gaps, now - last_key)
    if #gaps > 8 then
      table.remove(gaps, 1)
    end
  end
  last_key = now
  cancel_pending() -- at once: the running request is moot
  if shown then
    local cursor = api.nvim_win_get_cursor(0)
    local typed = ""
    if cursor[1] - 1 == shown.row and cursor[2] > shown.col then
      typed = (api.nvim_get_current_line()):sub(shown.col + 1, cursor[2])
    end
    G.dismiss(typed)
  end
  if not timer then
    timer = vim.loop.new_timer()
  end
  timer:stop()
  timer:start(G.debounce_ms(), 0, vim.schedule_wrap(core.guard(function()
    if api.nvim_get_mode().mode:sub(1, 1) == "i" then
      G.request()
    end
  end)))
end

local function on_cursor_moved()
  if shown then
    local cursor = api.nvim_win_get_cursor(0)
    if api.nvim_get_current_buf() ~= shown.buf or cursor[1] - 1 ~= shown.row or cursor[2] ~= shown.col then
      -- typing moves the cursor too: TextChangedI (after this) tells a typed character apart
      if api.nvim_buf_get_changedtick(shown.buf) == shown.tick then
        G.dismiss()
      end
    end
  end
end

local function on_leave()
  if timer then
    timer:stop()
  end
  cancel_pending()
  G.dismiss()
end

-- An insert-mode key that runs `fn` and, when it did nothing, does what the key did before.
local function map(key, fn, desc)
  if not key then
    return
  end
  local fallback = api.nvim_replace_termcodes(key, true, false, true)
  vim.keymap.set("i", key, function()
    local ok, done = pcall(fn)
    if not ok then
      core.error(tostring(done))
    elseif not done then
      api.nvim_feedkeys(fallback, "in", false) -- "n": not remapped, "i": right now
    end
  end, { desc = desc })
end

function G.setup(group, inline)
  opts = inline
  api.nvim_set_hl(0, "WarmspecGhost", { link = "Comment", default = true })
  if not inline.enabled then
    return
  end
  local function when_attached(fn)
    return function(args)
      if core.attached(args.buf) then
        core.guard(fn)(args)
      end
    end
  end
  api.nvim_create_autocmd("TextChangedI", { group = group, callback = when_attached(on_text_changed) })
  api.nvim_create_autocmd("CursorMovedI", { group = group, callback = on_cursor_moved })
  api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, { group = group, callback = on_leave })
  map(inline.accept_key, G.accept, "warmspec: accept the ghost text")
  map(inline.accept_word_key, G.accept_word, "warmspec: accept the next word of the ghost text")
  map(inline.accept_line_key, G.accept_line, "warmspec: accept the next line of the ghost text")
  map(inline.cycle_key, G.cycle, "warmspec: show another suggestion")
  if inline.trigger_key then
    vim.keymap.set("i", inline.trigger_key, function()
      G.request({ manual = true })
    end, { desc = "warmspec: suggest now" })
  end
end

return G
