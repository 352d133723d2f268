-- Commands only: nothing starts until require("warmspec").setup{} (buffers, ghost text) or one of
-- these commands is used.
if vim.g.loaded_warmspec then
  return
end
vim.g.loaded_warmspec = true

local function warmspec()
  return require("warmspec")
end

-- With a range (:'<,'>WarmspecAsk ...), the selected lines go to the model with the question.
vim.api.nvim_create_user_command("WarmspecAsk", function(cmd)
  local context = nil
  if cmd.range > 0 then
    local lines = vim.api.nvim_buf_get_lines(0, cmd.line1 - 1, cmd.line2, false)
    context = {
      name = ("lines %d-%d of %s"):format(cmd.line1, cmd.line2, vim.fn.expand("%:~:.")),
      filetype = vim.bo.filetype,
      text = table.concat(lines, "\n"),
    }
  end
  warmspec().guard(warmspec().ask)(cmd.args, context)
end, { nargs = "+", range = true, desc = "Ask warmspec; the answer streams into a scratch buffer" })

vim.api.nvim_create_user_command("WarmspecStatus", function()
  warmspec().guard(warmspec().status)()
end, { desc = "Show the warmspec daemon's model and statistics" })

vim.api.nvim_create_user_command("WarmspecStart", function()
  warmspec().guard(warmspec().start)()
end, { desc = "Start warmspec and attach this buffer" })

vim.api.nvim_create_user_command("WarmspecStop", function()
  warmspec().guard(warmspec().stop)()
end, { desc = "Stop the warmspec server" })

vim.api.nvim_create_user_command("WarmspecRestart", function()
  warmspec().guard(warmspec().restart)()
end, { desc = "Restart the warmspec server" })
