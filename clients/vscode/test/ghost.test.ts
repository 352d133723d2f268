// The ghost-text controller (src/ghost.ts) without a server: the adaptive debounce, and the
// feedback it derives from what happens to a suggestion shown in the editor.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { GhostController } from '../src/ghost';
import type { InlineCompletionFeedbackParams } from '../src/protocol';
import type { WarmspecSession } from '../src/session';

function controller() {
  const sent: InlineCompletionFeedbackParams[] = [];
  const fake = { feedback: async (p: InlineCompletionFeedbackParams) => void sent.push(p) } as unknown as WarmspecSession;
  const ghost = new GhostController(() => fake, { debounceMs: 150, adaptive: true, minMs: 30, maxMs: 600 });
  return { ghost, sent };
}

describe('ghost-text controller', () => {
  test('the debounce is at least 1.2x the median pause between keys, within bounds', () => {
    const { ghost } = controller();
    assert.equal(ghost.debounceMs(), 150);
    let t = 0;
    for (const gap of [0, 200, 210, 190, 220, 205]) {
      t += gap;
      ghost.keystroke(t);
    }
    assert.equal(ghost.debounceMs(), Math.floor(1.2 * 205));
    ghost.options = { ...ghost.options, adaptive: false };
    assert.equal(ghost.debounceMs(), 150);
  });

  test('typedWithin: keystrokes made while the server started ask again once it is up', () => {
    const { ghost } = controller();
    assert.equal(ghost.typedWithin(3000, 0), false); // nothing typed yet: ask nothing
    ghost.keystroke(1000);
    assert.equal(ghost.typedWithin(3000, 3999), true);
    assert.equal(ghost.typedWithin(3000, 4000), false);
  });

  test('accepting a word, then the rest, then a new suggestion', () => {
    const { ghost, sent } = controller();
    ghost.showing('file:///a.py', 10, 'return x + 1', 7);
    ghost.documentChanged('file:///a.py', 10, 0, 'return'); // Alt+Right
    ghost.documentChanged('file:///a.py', 16, 0, ' x + 1'); // Tab: all of it; the command says so
    ghost.accepted(7);
    ghost.showing('file:///a.py', 30, 'pass', 8);
    ghost.documentChanged('file:///a.py', 30, 0, 'q'); // typed something else
    assert.deepEqual(sent, [
      { id: 7, event: 'shown', index: 0 },
      { id: 7, event: 'partial', accepted_chars: 6, index: 0 },
      { id: 7, event: 'accepted', index: 0 },
      { id: 8, event: 'shown', index: 0 },
      { id: 8, event: 'dismissed', index: 0 },
    ]);
  });

  test('moving the cursor away dismisses it; a newer suggestion replaces it', () => {
    const { ghost, sent } = controller();
    ghost.showing('file:///a.py', 5, 'abc', 1);
    ghost.cursorMoved('file:///a.py', 5); // still there
    ghost.cursorMoved('file:///a.py', 0);
    ghost.showing('file:///a.py', 5, 'abc', 2);
    ghost.showing('file:///a.py', 6, 'bc', 3);
    assert.deepEqual(sent.map((p) => [p.id, p.event]), [[1, 'shown'], [1, 'dismissed'], [2, 'shown'],
                                                         [2, 'dismissed'], [3, 'shown']]);
  });
});
