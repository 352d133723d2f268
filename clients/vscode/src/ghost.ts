// Streamed ghost text, without VS Code: one running suggestion at a time, the text it has so far,
// the adaptive debounce, and what the user did with each suggestion (feedback). extension.ts wires
// it to VS Code's inline completion provider, which VS Code asks again (editor.action.inlineSuggest.
// trigger) on every partial, so the suggestion grows on screen; tests drive it in plain Node.

import { CancellationTokenSource } from 'vscode-jsonrpc/node';
import type { InlineCompletionInfo, Position, RequestId } from './protocol';
import type { WarmspecSession } from './session';

/** Where a suggestion was asked for: a document's version and a position in it. */
export interface Place {
  uri: string;
  version: number;
  position: Position;
}

export function samePlace(a: Place, b: Place): boolean {
  return a.uri === b.uri && a.version === b.version && a.position.line === b.position.line &&
    a.position.character === b.position.character;
}

export interface GhostOptions {
  debounceMs: number; // the configured debounce
  adaptive: boolean; // follow the server's advice and the user's pace
  minMs: number;
  maxMs: number;
  deadlineMs?: number | null;
}

/** One suggestion request: its text so far, then the final one. */
export class GhostStream {
  id: RequestId | undefined;
  text = '';
  final = false;
  info: InlineCompletionInfo | undefined;
  error: unknown;
  shownReported = false;
  readonly cancel = new CancellationTokenSource();
  private waiters: (() => void)[] = [];

  constructor(readonly place: Place) {}

  /** Resolves on the next partial, the final suggestion or an error. */
  changed(): Promise<void> {
    if (this.final || this.error !== undefined) {
      return Promise.resolve();
    }
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  update(fn: () => void): void {
    fn();
    const waiters = this.waiters;
    this.waiters = [];
    waiters.forEach((w) => w());
  }
}

/** The shown suggestion the user may be accepting in part, for feedback. */
interface Shown {
  uri: string;
  offset: number; // document offset of the suggestion's start
  text: string;
  id: RequestId;
  index: number;
  accepted: number; // characters accepted so far
}

export class GhostController {
  current: GhostStream | undefined;
  private advised: number | undefined;
  private gaps: number[] = [];
  private lastKey: number | undefined;
  private shown: Shown | undefined;

  constructor(private readonly session: () => WarmspecSession | undefined, public options: GhostOptions) {}

  /** The stream for `place`, if one is running or done there. */
  find(place: Place): GhostStream | undefined {
    return this.current && samePlace(this.current.place, place) ? this.current : undefined;
  }

  /** Start a suggestion at `place` (ending the one before); `onUpdate` runs on each partial and
   * at the end. */
  start(place: Place, onUpdate: (s: GhostStream) => void): GhostStream {
    this.cancelCurrent();
    const s = new GhostStream(place);
    this.current = s;
    const session = this.session();
    if (!session) {
      s.update(() => (s.error = new Error('the server is not running')));
      return s;
    }
    session.inlineCompletionStream(place.uri, place.position, (p) => {
      if (!s.final && p.text.length > s.text.length) {
        s.update(() => (s.text = p.text));
        onUpdate(s);
      }
    }, { token: s.cancel.token, deadlineMs: this.options.deadlineMs, onId: (id) => (s.id = id) }).then((result) => {
      s.update(() => {
        const item = result.items[0];
        const text = item ? (typeof item.insertText === 'string' ? item.insertText : item.insertText.value) : '';
        s.text = text;
        s.final = true;
        s.info = result.warmspec;
      });
      if (result.warmspec) {
        this.advised = result.warmspec.debounceMs;
      }
      onUpdate(s);
    }, (err) => s.update(() => (s.error = err)));
    return s;
  }

  /** Stop the running suggestion (its request gets `$/cancelRequest`). */
  cancelCurrent(): void {
    const s = this.current;
    if (s && !s.final && s.error === undefined) {
      s.cancel.cancel();
    }
    this.current = undefined;
  }

  /** A keystroke: its pause since the last one feeds the adaptive debounce. */
  keystroke(now: number = Date.now()): void {
    if (this.lastKey !== undefined && now - this.lastKey < 1000) {
      this.gaps.push(now - this.lastKey);
      if (this.gaps.length > 8) {
        this.gaps.shift();
      }
    }
    this.lastKey = now;
  }

  /** Whether the user typed in the last `ms` milliseconds. */
  typedWithin(ms: number, now: number = Date.now()): boolean {
    return this.lastKey !== undefined && now - this.lastKey < ms;
  }

  /** How long to wait before asking: the server's advice (or the configured debounce), but at
   * least 1.2x the user's median pause between keys, within [minMs, maxMs]. */
  debounceMs(): number {
    const o = this.options;
    let wait = (o.adaptive && this.advised !== undefined) ? this.advised : o.debounceMs;
    if (o.adaptive && this.gaps.length >= 4) {
      const sorted = [...this.gaps].sort((a, b) => a - b);
      wait = Math.max(wait, 1.2 * sorted[Math.ceil(sorted.length / 2) - 1]);
    }
    return Math.floor(Math.min(o.maxMs, Math.max(o.minMs, wait)));
  }

  // -- feedback -------------------------------------------------------------------------------

  /** A final suggestion was handed to the editor at `offset` of `uri`. */
  showing(uri: string, offset: number, text: string, id: RequestId, index = 0): void {
    if (this.shown && (this.shown.id !== id || this.shown.index !== index)) {
      this.dismissShown();
    }
    if (!this.shown) {
      this.shown = { uri, offset, text, id, index, accepted: 0 };
      void this.session()?.feedback({ id, event: 'shown', index });
    }
  }

  /** The user accepted all of it (the item's command). */
  accepted(id: RequestId, index = 0): void {
    if (this.shown && this.shown.id === id && this.shown.index === index) {
      this.shown = undefined;
    }
    void this.session()?.feedback({ id, event: 'accepted', index });
  }

  /** A change of `uri`: text inserted at `offset` (with `removed` characters replaced). Text that
   * continues the shown suggestion where the user got to (accept next word or line, or typing it)
   * counts as accepted in part; anything else dismisses it. */
  documentChanged(uri: string, offset: number, removed: number, inserted: string): void {
    const s = this.shown;
    if (!s || s.uri !== uri) {
      return;
    }
    const rest = s.text.slice(s.accepted);
    if (removed === 0 && offset === s.offset + s.accepted && inserted.length > 0 && rest.startsWith(inserted)) {
      s.accepted += inserted.length;
      if (s.accepted < s.text.length) { // all of it: the item's command reports it
        void this.session()?.feedback({ id: s.id, event: 'partial', accepted_chars: s.accepted, index: s.index });
      }
      return;
    }
    this.dismissShown();
  }

  /** The cursor is at `offset` of `uri`: away from the suggestion it dismisses it. */
  cursorMoved(uri: string, offset: number): void {
    const s = this.shown;
    if (s && (s.uri !== uri || offset !== s.offset + s.accepted)) {
      this.dismissShown();
    }
  }

  dismissShown(): void {
    const s = this.shown;
    this.shown = undefined;
    if (s) {
      void this.session()?.feedback({ id: s.id, event: 'dismissed', index: s.index });
    }
  }

  dispose(): void {
    this.cancelCurrent();
    this.shown = undefined;
  }
}
