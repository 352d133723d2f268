// Drives a real VS Code (code-server's workbench in headless Chromium) for tests/test_vscode_real.py:
// opens FILE, types TYPED at its end, waits for a ghost suggestion from the warmspec extension,
// takes a screenshot, accepts it with Tab, saves, and prints one JSON line: {"ghost": ...}.
//
//   node vscode_ghost.js URL FILE TYPED SCREENSHOT PATH DAEMONLOG  (PATH: FILE on disk;
//     DAEMONLOG: the daemon's log, which says when the editor's language client is connected;
//     PUPPETEER: the puppeteer-core module path)
//
// Every step waits for the state it needs (the cursor on the last line, the file saved as typed,
// the suggestion still for 1.5 s) and checks what the editor did by reading the saved file.

const fs = require('fs');
const puppeteer = require(process.env.PUPPETEER);

const [url, file, typed, screenshot, filePath, daemonLog] = process.argv.slice(2);
const GHOST = '.ghost-text-decoration, .ghost-text-decoration-preview, .ghost-text';

const pause = (ms) => new Promise((r) => setTimeout(r, ms));

function step(what) {
  process.stderr.write(`vscode_ghost: ${what}\n`);
}

async function main() {
  const browser = await puppeteer.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--window-size=1280,800'],
    defaultViewport: { width: 1280, height: 800 },
  });
  try {
    const page = await browser.newPage();
    page.setDefaultTimeout(240000);
    step(`opening ${url}`);
    await page.goto(url, { waitUntil: 'domcontentloaded' });
    await page.waitForSelector('.monaco-workbench', { timeout: 240000 });
    await page.waitForSelector('.explorer-folders-view, .explorer-viewlet', { timeout: 240000 });
    step('workbench up; opening the file with Quick Open');
    await page.keyboard.down('Control');
    await page.keyboard.press('KeyP');
    await page.keyboard.up('Control');
    await page.waitForSelector('.quick-input-widget input', { visible: true });
    await page.keyboard.type(file, { delay: 20 });
    await page.waitForSelector('.quick-input-list .monaco-list-row', { visible: true });
    await page.keyboard.press('Enter');
    await page.waitForSelector(`.tab[data-resource-name="${file}"], .tab[aria-label^="${file}"]`);
    await page.waitForSelector('.monaco-editor .view-lines');
    await page.click('.monaco-editor .view-lines');
    const ctrl = async (key) => {
      await page.keyboard.down('Control');
      await page.keyboard.press(key);
      await page.keyboard.up('Control');
    };
    // Saved and read back: the file on disk is what the editor did. ``until`` tells when to stop
    // waiting for the save to land (the tab's dirty mark is not reliable here: code-server may save by itself).
    const saved = async (until, ms = 10000) => {
      await ctrl('KeyS');
      const end = Date.now() + ms;
      let text = fs.readFileSync(filePath, 'utf8');
      while (!until(text) && Date.now() < end) {
        await pause(100);
        text = fs.readFileSync(filePath, 'utf8');
      }
      return text;
    };
    const original = fs.readFileSync(filePath, 'utf8');
    const lastLine = original.split('\n').length;  // Ctrl+End: the line after the final newline
    await ctrl('End');
    await page.waitForFunction(
      (ln) => (document.querySelector('.statusbar')?.innerText || '').includes(`Ln ${ln}, Col 1`),
      { timeout: 30000 }, lastLine);
    await page.waitForFunction(() => document.activeElement && document.activeElement.closest('.monaco-editor'),
                               { timeout: 30000 });
    // Keystrokes before the extension's language client is connected ask nothing (VS Code has no
    // inline provider yet, and does not ask again once one registers): wait for the daemon to
    // see the client's initialize, relayed by `warmspec lsp` (the client names itself after
    // the editor build, "code-server"). Typing at once cost every run here a 30 s wait and a retype.
    const connected = () => / initialized by (code-server|Visual Studio Code)/.test(fs.readFileSync(daemonLog, 'utf8'));
    for (const end = Date.now() + 120000; !connected(); ) {
      if (Date.now() > end) throw new Error('the language client did not connect to the daemon in 120 s');
      await pause(200);
    }
    step('language client connected; typing');
    await page.keyboard.type(typed, { delay: 60 });
    const base = original + typed;
    const typedFile = await saved((t) => t === base);
    if (typedFile !== base) throw new Error(`the typed text did not land at the end of the file: ${JSON.stringify(typedFile.slice(-80))}`);
    const ghostText = () => page.evaluate(
      (sel) => [...document.querySelectorAll(sel)].map((e) => e.textContent).join(''), GHOST);
    // The ghost text can come and go while the server starts (the first request waits for the
    // model), and a streamed suggestion changes as it grows: wait until one has stayed the same
    // for 1.5 s, within 15 s (a ghost that keeps vanishing once spun here until the test's
    // timeout); if none settles, retype the last character to ask again. Every text seen is
    // logged with its time, so a failure shows how the suggestion grew.
    const t0 = Date.now();
    async function stableGhost() {
      await page.waitForFunction(
        (sel) => [...document.querySelectorAll(sel)].some((e) => e.textContent.trim().length > 0),
        { timeout: 15000 }, GHOST);
      const end = Date.now() + 15000;
      let last = await ghostText();
      step(`+${Date.now() - t0} ms ghost ${JSON.stringify(last)}`);
      for (let still = 0; still < 15; ) {
        if (Date.now() > end) throw new Error(`the ghost text did not settle (last ${JSON.stringify(last)})`);
        await pause(100);
        const now = await ghostText();
        if (now !== last) step(`+${Date.now() - t0} ms ghost ${JSON.stringify(now)}`);
        still = now === last && now.trim() ? still + 1 : 0;
        last = now;
      }
      return last;
    }
    let ghost = '';
    let accepted = false;
    for (let attempt = 0; attempt < 8 && !accepted; attempt++) {
      try {
        ghost = await stableGhost();
      } catch (err) {
        step(`${err.message || err} (attempt ${attempt + 1}); retyping the last character`);
        await page.keyboard.press('Backspace');
        await page.keyboard.type(typed.slice(-1), { delay: 60 });
        continue;
      }
      step(`ghost text: ${JSON.stringify(ghost)}`);
      await page.screenshot({ path: screenshot });
      await page.keyboard.press('Tab');
      const now = await saved((t) => t !== base, 5000);
      if (now.startsWith(base) && now.slice(base.length).trim()) {
        accepted = true;
      } else if (now !== base) {
        // The suggestion went away just before Tab (a newer request replaced it): Tab indented.
        step('the suggestion was gone when Tab was pressed; undoing the indent');
        await ctrl('KeyZ');
        await saved((t) => t === base);
      }
    }
    if (!accepted) {
      await page.screenshot({ path: screenshot });
      throw new Error(ghost ? 'the ghost text was never accepted' : 'no ghost text appeared');
    }
    process.stdout.write(JSON.stringify({ ghost }) + '\n');
  } finally {
    await browser.close();
  }
}

main().catch((err) => {
  process.stderr.write(`vscode_ghost: ${err.stack || err}\n`);
  process.exit(1);
});
