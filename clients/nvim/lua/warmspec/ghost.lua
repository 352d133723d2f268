-- Ghost text: after a short idle in insert mode, ask the server for `textDocument/inlineCompletion`
-- at the cursor and show the answer as virtual text; <Tab> (configurable) inserts it, moving the
-- cursor or leaving insert mode dismisses it.
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

local opts = core.defaults.inline
local timer = nil
local pending = nil -- { client, id }
local shown = nil -- { buf, row, col, text, start_col, tick }
local reported = {} -- error messages already shown (one echo each, not one per keystroke)

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

local function cancel_pending()
  if pending then
    pcall(core.cancel, pending.client, pending.id)
    pending = nil
  end
end

function G.dismiss()
  if shown and api.nvim_buf_is_valid(shown.buf) then
    api.nvim_buf_clear_namespace(shown.buf, ns, 0, -1)
  end
  shown = nil
end

function G.visible()
  return shown ~= nil
end

-- The ghost text now shown: { buf, row, col, text } (row 0-based, col in bytes), or nil.
function G.current()
  return shown
end

local function render(buf, row, col, text)
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

-- The text of an InlineCompletionItem that is still to be typed at the cursor, and the byte
-- column where the item's text starts (it may replace what was typed since its range's start).
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
  return rest ~= "" and rest or nil, start_col
end

-- Ask for ghost text at the cursor now. opts.manual: asked by the user (also outside insert mode).
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
  local tick = api.nvim_buf_get_changedtick(buf)
  local cursor = api.nvim_win_get_cursor(win)
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
    -- Stale: the user typed or moved while the model was thinking.
    if api.nvim_get_current_buf() ~= buf or api.nvim_buf_get_changedtick(buf) ~= tick
      or not vim.deep_equal(api.nvim_win_get_cursor(0), cursor)
      or (not req.manual and api.nvim_get_mode().mode:sub(1, 1) ~= "i") then
      return
    end
    local items = result and (result.items or result) or {}
    local item = items[1]
    if not item then
      return
    end
    local row, col = cursor[1] - 1, cursor[2]
    local line = api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ""
    local text, start_col = ghost_of(item, line, col, client.offset_encoding)
    if not text then
      return
    end
    G.dismiss()
    render(buf, row, col, text)
    shown = { buf = buf, row = row, col = col, text = text, start_col = start_col, tick = tick }
  end), buf)
  if id then
    pending = { client = client, id = id }
  end
end

-- Insert the ghost text and put the cursor after it. Returns false when none was shown.
function G.accept()
  local g = shown
  if not g or not api.nvim_buf_is_valid(g.buf) or api.nvim_get_current_buf() ~= g.buf then
    G.dismiss()
    return false
  end
  G.dismiss()
  local lines = vim.split(g.text, "\n", { plain = true })
  api.nvim_buf_set_text(g.buf, g.row, g.col, g.row, g.col, lines)
  local last_row = g.row + #lines - 1
  local last_col = (#lines == 1 and g.col or 0) + #lines[#lines]
  api.nvim_win_set_cursor(0, { last_row + 1, last_col })
  return true
end

local function on_text_changed()
  G.dismiss()
  cancel_pending()
  if not timer then
    timer = vim.loop.new_timer()
  end
  timer:stop()
  timer:start(opts.debounce_ms, 0, vim.schedule_wrap(core.guard(function()
    if api.nvim_get_mode().mode:sub(1, 1) == "i" then
      G.request()
    end
  end)))
end

local function on_cursor_moved()
  if shown then
    local cursor = api.nvim_win_get_cursor(0)
    if api.nvim_get_current_buf() ~= shown.buf or cursor[1] - 1 ~= shown.row or cursor[2] ~= shown.col then
      G.dismiss()
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

function G.setup(group, inline)
  opts = inline
  api.nvim_set_hl(0, "WarmspecGhost", { link = "Comment", default = true })
  if not inline.enabled then
    return
  end
  local function when_attached(fn)
    return function(args)
      if core.attached(args.buf) then
        core.guard(fn)()
      end
    end
  end
  api.nvim_create_autocmd("TextChangedI", { group = group, callback = when_attached(on_text_changed) })
  api.nvim_create_autocmd("CursorMovedI", { group = group, callback = on_cursor_moved })
  api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, { group = group, callback = on_leave })
  if inline.accept_key then
    local fallback = api.nvim_replace_termcodes(inline.accept_key, true, false, true)
    vim.keymap.set("i", inline.accept_key, function()
      local ok, accepted = pcall(G.accept)
      if not ok then
        core.error(tostring(accepted))
      elseif not accepted then
        -- No ghost text: the key does what it did before ("n": not remapped, "i": right now).
        api.nvim_feedkeys(fallback, "in", false)
      end
    end, { desc = "warmspec: accept the ghost text" })
  end
  if inline.trigger_key then
    vim.keymap.set("i", inline.trigger_key, function()
      G.request({ manual = true })
    end, { desc = "warmspec: suggest now" })
  end
end

return G
