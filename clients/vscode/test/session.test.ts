// The session module against a real `warmspec lsp`, over vscode-jsonrpc: what the extension does,
// without VS Code. Run by tests/test_clients_vscode.py (compiled by tsc into out/):
//
//   WARMSPEC_TEST_CMD='["warmspec", "lsp", "--workspace", "/tmp/ws"]' node --test out/test/
//
// WARMSPEC_TEST_WORKSPACE is the workspace root given to the server (a directory of the test's own).

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import * as path from 'node:path';
import { pathToFileURL } from 'node:url';
import { CancellationTokenSource, ResponseError } from 'vscode-jsonrpc/node';
import { DeltaParams, InlineCompletionPartialParams, RequestId } from '../src/protocol';
import { ServerProcess, spawnServer, summary } from '../src/session';

const [command, ...args] = JSON.parse(process.env.WARMSPEC_TEST_CMD ?? '["warmspec", "lsp"]') as string[];
const workspace = process.env.WARMSPEC_TEST_WORKSPACE ?? process.cwd();

const SOURCE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    return fib';
const URI = pathToFileURL(path.join(workspace, 'example.py')).href;

function errorCode(err: unknown): number | undefined {
  return err instanceof ResponseError ? err.code : (err as { code?: number }).code;
}

describe('warmspec lsp through the session module', () => {
  let server: ServerProcess;
  let stderr = '';

  before(async () => {
    server = spawnServer(command, args, { cwd: workspace }, (chunk) => (stderr += chunk));
  });

  after(async () => {
    if (server.process.exitCode === null) {
      server.process.kill();
    }
  });

  test('initialize advertises inline completion and full text sync', async () => {
    const result = await server.initialize({ inlineCompletion: { maxTokens: 12, stream: true, adapt: false } });
    assert.equal(result.serverInfo.name, 'warmspec', stderr);
    assert.ok(result.capabilities.inlineCompletionProvider, JSON.stringify(result.capabilities));
    const sync = result.capabilities.textDocumentSync;
    assert.equal(typeof sync === 'number' ? sync : sync.change, 1); // TextDocumentSyncKind.Full
  });

  test('models and status', async () => {
    const models = await server.session.models();
    assert.equal(models.models[0].id, 'SmolLM2-135M-Instruct');
    const status = await server.session.status();
    assert.equal(status.model.id, 'SmolLM2-135M-Instruct');
    assert.equal(typeof status.uptime_s, 'number');
  });

  test('chat streams deltas tied to its request, then the result', async () => {
    const deltas: DeltaParams[] = [];
    const result = await server.session.chat(
      { messages: [{ role: 'user', content: 'Say hello in one short sentence.' }], max_tokens: 16, temperature: 0 },
      (d) => deltas.push(d));
    assert.ok(deltas.length >= 2, `${deltas.length} deltas`);
    assert.equal(new Set(deltas.map((d) => d.id)).size, 1);
    assert.equal(deltas.map((d) => d.text).join(''), result.text);
    assert.equal(deltas.reduce((n, d) => n + d.tokens, 0), result.stats.completion_tokens);
    assert.ok(result.stats.passes > 0 && result.tok_s > 0 && result.ttft_s > 0);
    assert.match(summary(result), /^\d+ tokens, [\d.]+ tok\/s, [\d.]+ tok\/pass \(\d+ passes, .*first token \d+ ms \((stop|length)\)$/);
  });

  test('complete continues a raw prompt, streamed the same way', async () => {
    const deltas: string[] = [];
    const result = await server.session.complete(
      { prompt: 'def add(a, b):\n    return', max_tokens: 8, temperature: 0, stop: ['\n'] }, (d) => deltas.push(d.text));
    assert.equal(deltas.join(''), result.text);
    assert.ok(result.stats.completion_tokens >= 1 && result.stats.completion_tokens <= 8);
  });

  test('two answers at once each get only their own deltas', async () => {
    const a: string[] = [];
    const b: string[] = [];
    const ask = (content: string, into: string[]) => server.session.chat(
      { messages: [{ role: 'user', content }], max_tokens: 8, temperature: 0 }, (d) => into.push(d.text));
    const [ra, rb] = await Promise.all([ask('Name a colour.', a), ask('Name an animal.', b)]);
    assert.equal(a.join(''), ra.text);
    assert.equal(b.join(''), rb.text);
    assert.ok(a.length > 0 && b.length > 0);
  });

  test('inline completion at the cursor of an open document', async () => {
    await server.connection.sendNotification('textDocument/didOpen', {
      textDocument: { uri: URI, languageId: 'python', version: 1, text: SOURCE },
    });
    const lines = SOURCE.split('\n');
    const end = { line: lines.length - 1, character: lines[lines.length - 1].length };
    const items = await server.session.inlineCompletion(URI, end);
    assert.equal(items.length, 1, stderr.slice(-2000));
    const text = items[0].insertText as string;
    assert.ok(text.length > 0);
    assert.deepEqual(items[0].range, { start: end, end });

    // Full-text sync: after a change the server completes the new text.
    const changed = SOURCE + 'onacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n    return ';
    await server.connection.sendNotification('textDocument/didChange', {
      textDocument: { uri: URI, version: 2 }, contentChanges: [{ text: changed }],
    });
    const last = changed.split('\n');
    const items2 = await server.session.inlineCompletion(URI, { line: last.length - 1, character: last[last.length - 1].length });
    assert.equal(items2.length, 1);
  });

  test('a newer inline completion for the same document replaces the older one', async () => {
    const first = server.session.inlineCompletion(URI, { line: 0, character: 4 });
    const second = server.session.inlineCompletion(URI, { line: 1, character: 4 });
    await assert.rejects(first, (err) => errorCode(err) === -32801); // ContentModified
    await second;
  });

  test('ghost text streams: partials of the request, then the final result with its timings', async () => {
    const text = 'def factorial(n):\n    """Return n!"""\n    ';
    const uri = pathToFileURL(path.join(workspace, 'stream.py')).href;
    await server.connection.sendNotification('textDocument/didOpen', {
      textDocument: { uri, languageId: 'python', version: 1, text },
    });
    const partials: InlineCompletionPartialParams[] = [];
    let id: RequestId | undefined;
    const result = await server.session.inlineCompletionStream(uri, { line: 2, character: 4 }, (p) => partials.push(p),
      { onId: (requestId) => (id = requestId) });
    const final = result.items[0].insertText as string;
    assert.ok(partials.length >= 1, stderr.slice(-2000));
    assert.ok(partials.every((p) => p.id === id && p.uri === uri && p.position.line === 2));
    assert.equal(partials[partials.length - 1].text, final);
    assert.ok(result.warmspec && result.warmspec.tokens > 0 && ['stop', 'length'].includes(result.warmspec.finish));
    assert.ok(result.warmspec.finalMs >= (result.warmspec.firstVisibleMs ?? 0));

    // Feedback on it is counted for the document; alternatives start with the same suggestion.
    await server.session.feedback({ id: id!, event: 'shown' });
    await server.session.feedback({ id: id!, event: 'partial', accepted_chars: 1 });
    await server.session.feedback({ id: id!, event: 'accepted' });
    const status = await server.session.status();
    const doc = status.inline!.documents[uri];
    assert.deepEqual([doc.shown, doc.partial, doc.accepted], [1, 1, 1]);
    const alts = await server.session.alternatives({ uri, position: { line: 2, character: 4 }, count: 2 });
    assert.equal(alts.items[0].text, final);
    assert.equal(alts.items[0].seed, null);
  });

  test('next edit after renaming one of three call sites', async () => {
    const before = 'def fetch_rows(db):\n    return db\n\n\na = fetch_rows(1)\nb = fetch_rows(2)\nc = fetch_rows(3)\n';
    const uri = pathToFileURL(path.join(workspace, 'rows.py')).href;
    await server.connection.sendNotification('textDocument/didOpen', {
      textDocument: { uri, languageId: 'python', version: 1, text: before },
    });
    await server.connection.sendNotification('textDocument/didChange', {
      textDocument: { uri, version: 2 }, contentChanges: [{ text: before.replace('a = fetch_rows', 'a = load_rows') }],
    });
    const { edit } = await server.session.nextEdit({ uri, position: { line: 4, character: 13 } });
    assert.ok(edit);
    assert.deepEqual(edit.range, { start: { line: 5, character: 4 }, end: { line: 5, character: 14 } });
    assert.equal(edit.text, 'load_rows');
    assert.equal(edit.kind, 'rename');
    assert.equal(edit.remaining, 3);
  });

  test('inline completion of a document that is not open is an error', async () => {
    await assert.rejects(server.session.inlineCompletion('file:///nowhere/x.py', { line: 0, character: 0 }),
      (err) => errorCode(err) === -32602 && /not open/.test((err as Error).message));
  });

  test('cancelling an answer sends $/cancelRequest and stops it', async () => {
    const source = new CancellationTokenSource();
    const deltas: string[] = [];
    const answer = server.session.chat(
      { messages: [{ role: 'user', content: 'Count from one to one hundred, one number per line.' }], max_tokens: 400 },
      (d) => {
        deltas.push(d.text);
        source.cancel();
      },
      source.token);
    await assert.rejects(answer, (err) => errorCode(err) === -32800); // RequestCancelled
    // The decoding stops within a step: the daemon is idle again soon after.
    let active = true;
    for (let i = 0; i < 50 && active; i++) {
      active = (await server.session.status()).active;
      if (active) {
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    }
    assert.equal(active, false);
    assert.ok(deltas.length >= 1 && deltas.length < 50, `${deltas.length} deltas`);
  });

  test('didRead of a file outside the workspace is refused', async () => {
    await assert.rejects(server.session.didRead({ path: '/etc/hostname' }), (err) => errorCode(err) === -31002);
  });

  test('shutdown and exit end the server with code 0', async () => {
    assert.equal(await server.shutdown(), 0);
  });
});
