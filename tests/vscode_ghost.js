// Drives a real VS Code (code-server's workbench in headless Chromium) for tests/test_vscode_real.py:
// opens FILE, types TYPED at its end, waits for a ghost suggestion from the warmspec extension,
// takes a screenshot, accepts it with Tab, saves, and prints one JSON line: {"ghost": ...}.
//
//   node vscode_ghost.js URL FILE TYPED SCREENSHOT     (PUPPETEER: the puppeteer-core module path)

const puppeteer = require(process.env.PUPPETEER);

const [url, file, typed, screenshot] = process.argv.slice(2);
const GHOST = '.ghost-text-decoration, .ghost-text-decoration-preview, .ghost-text';

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
    await page.keyboard.down('Control');
    await page.keyboard.press('End');
    await page.keyboard.up('Control');
    step('typing');
    // The ghost text can come and go while the server starts (the first request waits for the
    // model); type, and if nothing shows within a while, retype the last character to ask again.
    await page.keyboard.type(typed, { delay: 60 });
    let ghost = '';
    for (let attempt = 0; attempt < 8 && !ghost; attempt++) {
      try {
        await page.waitForFunction(
          (sel) => [...document.querySelectorAll(sel)].some((e) => e.textContent.trim().length > 0),
          { timeout: 30000 }, GHOST);
        ghost = await page.evaluate(
          (sel) => [...document.querySelectorAll(sel)].map((e) => e.textContent).join(''), GHOST);
      } catch (err) {
        step(`no ghost text yet (attempt ${attempt + 1}); retyping the last character`);
        await page.keyboard.press('Backspace');
        await page.keyboard.type(typed.slice(-1), { delay: 60 });
      }
    }
    if (!ghost) {
      await page.screenshot({ path: screenshot });
      throw new Error('no ghost text appeared');
    }
    step(`ghost text: ${JSON.stringify(ghost)}`);
    await page.screenshot({ path: screenshot });
    await page.keyboard.press('Tab');
    await page.waitForFunction((sel) => document.querySelectorAll(sel).length === 0, { timeout: 30000 }, GHOST);
    await page.keyboard.down('Control');
    await page.keyboard.press('KeyS');
    await page.keyboard.up('Control');
    await page.waitForFunction(() => !document.querySelector('.tab.dirty'), { timeout: 30000 });
    process.stdout.write(JSON.stringify({ ghost }) + '\n');
  } finally {
    await browser.close();
  }
}

main().catch((err) => {
  process.stderr.write(`vscode_ghost: ${err.stack || err}\n`);
  process.exit(1);
});
