// The VS Code extension: `warmspec lsp` as a language server for every file (document sync comes
// from vscode-languageclient, whose inline completion feature registers the provider for LSP
// 3.18's textDocument/inlineCompletion), plus "Warmspec: Ask" streaming an answer into an output
// channel. The warmspec methods themselves live in session.ts.
//
// Ghost text streams: the provider (the languageclient's, through its middleware) starts the
// request after an adaptive debounce and answers with the suggestion so far; each partial the
// server sends re-triggers VS Code's inline suggestion (editor.action.inlineSuggest.trigger), so
// it grows on screen (ghost.ts). A change of the document cancels the request at once. Accepting
// the next word or line is VS Code's own (editor.action.inlineSuggest.acceptNextWord / NextLine,
// bound to Alt+Right / Alt+Down); "Warmspec: Show Alternatives" (Ctrl+Alt+]) asks for several
// suggestions, which VS Code then cycles (Alt+] / Alt+[).
//
// Next-edit suggestions: VS Code 1.91 (this extension's engine) has no stable inline edit API --
// inline edits are a proposed API (`inlineEdit`, later `inlineCompletionsAdditions`), which an
// extension can only use when VS Code runs with proposals enabled for it, never from the
// marketplace. So the next edit is a decoration (the text it replaces struck through, the
// replacement after the line) and "Warmspec: Apply the Next Edit" (Alt+N) jumps there and applies
// it.

import { ChildProcess, spawn } from 'child_process';
import * as vscode from 'vscode';
import { StreamMessageReader, StreamMessageWriter } from 'vscode-jsonrpc/node';
import { LanguageClient, LanguageClientOptions, MessageTransports } from 'vscode-languageclient/node';
import { GhostController, GhostStream, Place, samePlace } from './ghost';
import { Alternative, ErrorCode, Message, NextEdit, RequestId } from './protocol';
import { RequestTap, WarmspecSession, formatStatus, summary } from './session';

let client: LanguageClient | undefined;
let session: WarmspecSession | undefined;
let server: ChildProcess | undefined;
let answers: vscode.OutputChannel;
let log: vscode.LogOutputChannel;
let asking: vscode.CancellationTokenSource | undefined;
let ghost: GhostController;
let alternatives: { place: Place; items: Alternative[]; id: RequestId } | undefined;
let nextEdit: { uri: string; version: number; edit: NextEdit; editor: vscode.TextEditor } | undefined;
let nextEditTimer: NodeJS.Timeout | undefined;
let nextEditDecoration: vscode.TextEditorDecorationType;

function config() {
  return vscode.workspace.getConfiguration('warmspec');
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  answers = vscode.window.createOutputChannel('warmspec');
  log = vscode.window.createOutputChannel('warmspec server', { log: true });
  ghost = new GhostController(() => session, ghostOptions());
  nextEditDecoration = vscode.window.createTextEditorDecorationType({
    backgroundColor: new vscode.ThemeColor('diffEditor.removedTextBackground'),
    textDecoration: 'line-through',
  });
  context.subscriptions.push(
    answers,
    log,
    nextEditDecoration,
    { dispose: () => ghost.dispose() },
    vscode.commands.registerCommand('warmspec.accepted', (id: RequestId, index: number) => ghost.accepted(id, index)),
    vscode.commands.registerCommand('warmspec.alternatives', showAlternatives),
    vscode.commands.registerCommand('warmspec.nextEdit', applyNextEdit),
    vscode.workspace.onDidChangeTextDocument(onDocumentChanged),
    vscode.window.onDidChangeTextEditorSelection((e) => {
      if (client && e.selections.length === 1) {
        ghost.cursorMoved(client.code2ProtocolConverter.asUri(e.textEditor.document.uri),
          e.textEditor.document.offsetAt(e.selections[0].active));
      }
    }),
    vscode.commands.registerCommand('warmspec.ask', ask),
    vscode.commands.registerCommand('warmspec.cancel', () => asking?.cancel()),
    vscode.commands.registerCommand('warmspec.status', showStatus),
    vscode.commands.registerCommand('warmspec.restart', restart),
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (e.affectsConfiguration('warmspec.server') || e.affectsConfiguration('warmspec.inlineCompletion.maxTokens')
          || e.affectsConfiguration('warmspec.inlineCompletion.prefetch')) {
        await restart();
      }
      if (e.affectsConfiguration('warmspec.inlineCompletion')) {
        ghost.options = ghostOptions();
      }
    }),
  );
  void start(); // not awaited: the model loads for seconds, and activation should not wait on it
}

export async function deactivate(): Promise<void> {
  await stop();
}

async function start(): Promise<void> {
  let tap: RequestTap | undefined;
  // The server is spawned here rather than by the languageclient so that its writer can be
  // tapped for request ids (see session.ts); the languageclient calls this again on a restart.
  const serverOptions = async (): Promise<MessageTransports> => {
    const command = config().get<string>('server.command', 'warmspec');
    const args = config().get<string[]>('server.args', ['lsp']);
    const cwd = vscode.workspace.workspaceFolders?.[0]?.uri.fsPath;
    const child = spawn(command, args, { cwd, stdio: ['pipe', 'pipe', 'pipe'] });
    await new Promise<void>((resolve, reject) => {
      child.once('spawn', resolve);
      child.once('error', (err) => reject(new Error(
        `cannot start "${command}": ${err.message} (set warmspec.server.command)`)));
    });
    child.stderr!.setEncoding('utf8');
    child.stderr!.on('data', (chunk: string) => log.append(chunk));
    server = child;
    tap = new RequestTap(new StreamMessageWriter(child.stdin!));
    if (client) {
      session?.dispose();
      session = new WarmspecSession(client, tap);
    }
    return { reader: new StreamMessageReader(child.stdout!), writer: tap };
  };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: {
      inlineCompletion: {
        maxTokens: config().get<number>('inlineCompletion.maxTokens', 48),
        stream: true,
        debounceMs: config().get<number>('inlineCompletion.debounceMs', 150),
        adapt: config().get<boolean>('inlineCompletion.adaptive', true),
        prefetch: config().get<boolean>('inlineCompletion.prefetch', true),
      },
    },
    outputChannel: log,
    middleware: {
      provideInlineCompletionItems: (document, position, ctx, token, next) => {
        if (!config().get<boolean>('inlineCompletion.enabled', true)) {
          return undefined;
        }
        return session ? provideGhost(document, position, ctx, token) : next(document, position, ctx, token);
      },
    },
  };
  client = new LanguageClient('warmspec', 'warmspec', serverOptions, clientOptions);
  try {
    await client.start();
  } catch (err) {
    vscode.window.showErrorMessage(`warmspec: ${errorText(err)}`);
    return;
  }
  // Keystrokes made while the server started asked for nothing (VS Code had no inline provider
  // yet, and it does not ask again once one registers): ask once where the user is typing.
  if (ghost.typedWithin(3000)) {
    void vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
  }
}

async function stop(): Promise<void> {
  asking?.cancel();
  ghost.dispose();
  clearNextEdit();
  session?.dispose();
  session = undefined;
  try {
    await client?.stop(5000);
  } catch {
    // stopping a server that never started, or one that died: nothing left to do
  }
  client = undefined;
  if (server && server.exitCode === null) {
    server.kill();
  }
  server = undefined;
}

async function restart(): Promise<void> {
  await stop();
  await start();
}

/** The session once the server is up: start() waits for one that is starting (the model loads
 * first) and starts one that stopped. */
async function ready(): Promise<WarmspecSession | undefined> {
  try {
    await client?.start();
  } catch (err) {
    vscode.window.showErrorMessage(`warmspec: ${errorText(err)}`);
    return undefined;
  }
  if (!session || !client?.isRunning()) {
    vscode.window.showErrorMessage('warmspec: the server is not running (Warmspec: Restart the Server)');
    return undefined;
  }
  return session;
}

function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

async function ask(): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  const selection = editor && !editor.selection.isEmpty ? editor.document.getText(editor.selection) : '';
  const question = await vscode.window.showInputBox({
    prompt: selection ? 'Ask warmspec about the selection' : 'Ask warmspec',
    placeHolder: 'a question',
  });
  if (!question) {
    return;
  }
  const s = await ready();
  if (!s) {
    return;
  }
  let content = question;
  if (selection && editor) {
    const name = vscode.workspace.asRelativePath(editor.document.uri);
    content = `Here is a part of ${name}:\n\`\`\`${editor.document.languageId}\n${selection}\n\`\`\`\n\n${question}`;
  }
  const messages: Message[] = [{ role: 'user', content }];
  asking?.cancel();
  const source = (asking = new vscode.CancellationTokenSource());
  answers.show(true);
  answers.appendLine(`> ${question}`);
  answers.appendLine('');
  await vscode.window.withProgress(
    { location: vscode.ProgressLocation.Window, title: 'warmspec: answering', cancellable: true },
    async (_progress, token) => {
      token.onCancellationRequested(() => source.cancel());
      try {
        const result = await s.chat(
          { messages, max_tokens: config().get<number>('ask.maxTokens', 512),
            temperature: config().get<number | null>('ask.temperature', null) },
          (delta) => answers.append(delta.text),
          source.token,
        );
        answers.appendLine('');
        answers.appendLine(`-- ${summary(result)}`);
      } catch (err) {
        const cancelled = (err as { code?: number }).code === ErrorCode.RequestCancelled;
        answers.appendLine('');
        answers.appendLine(cancelled ? '-- cancelled' : `-- error: ${errorText(err)}`);
        if (!cancelled) {
          vscode.window.showErrorMessage(`warmspec: ${errorText(err)}`);
        }
      } finally {
        answers.appendLine('');
        if (asking === source) {
          asking = undefined;
        }
        source.dispose();
      }
    },
  );
}

async function showStatus(): Promise<void> {
  const s = await ready();
  if (!s) {
    return;
  }
  try {
    const lines = formatStatus(await s.status());
    answers.appendLine(lines.map((line) => `# ${line}`).join('\n'));
    vscode.window.showInformationMessage(`warmspec: ${lines[0]}`);
  } catch (err) {
    vscode.window.showErrorMessage(`warmspec: ${errorText(err)}`);
  }
}

// -- ghost text ---------------------------------------------------------------------------------

function ghostOptions() {
  const c = config();
  return {
    debounceMs: c.get<number>('inlineCompletion.debounceMs', 150),
    adaptive: c.get<boolean>('inlineCompletion.adaptive', true),
    minMs: 30,
    maxMs: 600,
    deadlineMs: c.get<number | null>('inlineCompletion.deadlineMs', null),
  };
}

function placeOf(document: vscode.TextDocument, position: vscode.Position): Place | undefined {
  if (!client) {
    return undefined;
  }
  return { uri: client.code2ProtocolConverter.asUri(document.uri), version: document.version,
           position: { line: position.line, character: position.character } };
}

function sleep(ms: number, token: vscode.CancellationToken): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    token.onCancellationRequested(() => {
      clearTimeout(timer);
      resolve();
    });
  });
}

let retriggering = false;
let retriggerAgain = false;

/** A partial arrived: ask VS Code to ask again (once at a time), if the editor is still there.
 * Hidden first: VS Code fetches again only when what it fetched for changed (the document, the
 * cursor, an automatic request turning explicit), so a second `trigger` at the same place did
 * nothing. In code-server 4.139 the first partial showed and the rest of the suggestion never
 * did: the ghost stayed " -" while the finished suggestion was " - b" (tests/test_vscode_real.py). */
function retrigger(stream: GhostStream): void {
  const editor = vscode.window.activeTextEditor;
  const place = editor && placeOf(editor.document, editor.selection.active);
  if (!place || ghost.current !== stream || !samePlace(place, stream.place)) {
    return;
  }
  if (retriggering) {
    retriggerAgain = true;
    return;
  }
  retriggering = true;
  const again = async () => {
    await vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
    await vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
  };
  again().then(() => {
    retriggering = false;
    if (retriggerAgain) {
      retriggerAgain = false;
      retrigger(stream);
    }
  }, () => (retriggering = false));
}

async function provideGhost(document: vscode.TextDocument, position: vscode.Position,
                            ctx: vscode.InlineCompletionContext,
                            token: vscode.CancellationToken): Promise<vscode.InlineCompletionItem[] | undefined> {
  const place = placeOf(document, position);
  if (!place) {
    return undefined;
  }
  const range = new vscode.Range(position, position);
  const offset = document.offsetAt(position);
  if (alternatives && samePlace(alternatives.place, place)) {
    const { items, id } = alternatives;
    // the greedy one (shown already) last, so the first shown is another
    const order = items.map((_, i) => i).slice(1).concat([0]);
    return order.map((i) => {
      const item = new vscode.InlineCompletionItem(items[i].text, range);
      item.command = { command: 'warmspec.accepted', title: 'accepted', arguments: [id, i] };
      return item;
    });
  }
  let stream = ghost.find(place);
  if (!stream || stream.error !== undefined) { // none here yet, or it failed: ask (again)
    ghost.cancelCurrent();
    if (ctx.triggerKind === vscode.InlineCompletionTriggerKind.Automatic) {
      await sleep(ghost.debounceMs(), token);
      if (token.isCancellationRequested || document.version !== place.version) {
        return undefined;
      }
    }
    stream = ghost.start(place, retrigger);
  }
  if (!stream.text && !stream.final && stream.error === undefined) {
    await Promise.race([stream.changed(), sleep(10_000, token)]);
  }
  if (token.isCancellationRequested || !stream.text) {
    if (stream.error !== undefined && (stream.error as { code?: number }).code === undefined) {
      log.warn(`inline completion: ${errorText(stream.error)}`);
    }
    return undefined;
  }
  const item = new vscode.InlineCompletionItem(stream.text, range);
  if (stream.final && stream.id !== undefined) {
    item.command = { command: 'warmspec.accepted', title: 'accepted', arguments: [stream.id, 0] };
    ghost.showing(place.uri, offset, stream.text, stream.id);
  }
  return [item];
}

function onDocumentChanged(e: vscode.TextDocumentChangeEvent): void {
  if (!client || e.contentChanges.length === 0) {
    return;
  }
  const uri = client.code2ProtocolConverter.asUri(e.document.uri);
  if (ghost.current?.place.uri === uri) {
    ghost.cancelCurrent(); // at once: the running suggestion is moot
  }
  if (alternatives?.place.uri === uri) {
    alternatives = undefined;
  }
  const active = vscode.window.activeTextEditor?.document === e.document;
  if (active) {
    ghost.keystroke();
  }
  for (const change of e.contentChanges) {
    ghost.documentChanged(uri, change.rangeOffset, change.rangeLength, change.text);
  }
  if (nextEdit?.uri === uri) {
    clearNextEdit();
  }
  if (active && config().get<boolean>('nextEdit.enabled', true)) {
    if (nextEditTimer) {
      clearTimeout(nextEditTimer);
    }
    nextEditTimer = setTimeout(() => void askNextEdit(), config().get<number>('nextEdit.delayMs', 400));
  }
}

async function showAlternatives(): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  const s = await ready();
  const place = editor && placeOf(editor.document, editor.selection.active);
  if (!s || !editor || !place) {
    return;
  }
  try {
    let id: RequestId | undefined;
    const result = await s.alternatives({ uri: place.uri, position: place.position,
                                          count: config().get<number>('inlineCompletion.alternatives', 3) },
                                        (requestId) => (id = requestId));
    if (result.items.length === 0 || id === undefined) {
      vscode.window.setStatusBarMessage('warmspec: no suggestion here', 3000);
      return;
    }
    alternatives = { place, items: result.items, id };
    await vscode.commands.executeCommand('editor.action.inlineSuggest.trigger');
  } catch (err) {
    vscode.window.showErrorMessage(`warmspec: ${errorText(err)}`);
  }
}

// -- next-edit suggestions ------------------------------------------------------------------------

function clearNextEdit(): void {
  if (nextEdit) {
    nextEdit.editor.setDecorations(nextEditDecoration, []);
  }
  nextEdit = undefined;
  void vscode.commands.executeCommand('setContext', 'warmspec.nextEditVisible', false);
}

function toRange(r: NextEdit['range']): vscode.Range {
  return new vscode.Range(r.start.line, r.start.character, r.end.line, r.end.character);
}

async function askNextEdit(): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  const place = editor && placeOf(editor.document, editor.selection.active);
  if (!session || !editor || !place) {
    return;
  }
  let result;
  try {
    result = await session.nextEdit({ uri: place.uri, position: place.position });
  } catch (err) {
    log.warn(`next edit: ${errorText(err)}`);
    return;
  }
  if (!result.edit || editor.document.version !== place.version) {
    return;
  }
  clearNextEdit();
  const edit = result.edit;
  nextEdit = { uri: place.uri, version: place.version, edit, editor };
  editor.setDecorations(nextEditDecoration, [{
    range: toRange(edit.range),
    renderOptions: { after: { contentText: `  → ${edit.text.split('\n')[0]}  (Alt+N)`,
                              color: new vscode.ThemeColor('editorGhostText.foreground') } },
  }]);
  void vscode.commands.executeCommand('setContext', 'warmspec.nextEditVisible', true);
}

/** Jump to the suggested next edit and apply it; the next one is asked for after it. */
async function applyNextEdit(): Promise<void> {
  const n = nextEdit;
  const editor = vscode.window.activeTextEditor;
  if (!n || !editor || editor.document.version !== n.version || n.editor.document !== editor.document) {
    clearNextEdit();
    return;
  }
  clearNextEdit();
  const range = toRange(n.edit.range);
  const ok = await editor.edit((b) => b.replace(range, n.edit.text));
  if (ok) {
    const end = editor.document.positionAt(editor.document.offsetAt(range.start) + n.edit.text.length);
    editor.selection = new vscode.Selection(end, end);
    editor.revealRange(new vscode.Range(end, end));
  }
}
