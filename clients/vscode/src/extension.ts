// The VS Code extension: `warmspec lsp` as a language server for every file (document sync and
// ghost text come from vscode-languageclient, whose built-in inline completion feature speaks
// LSP 3.18's textDocument/inlineCompletion), plus "Warmspec: Ask" streaming an answer into an
// output channel. The warmspec methods themselves live in session.ts.

import { ChildProcess, spawn } from 'child_process';
import * as vscode from 'vscode';
import { StreamMessageReader, StreamMessageWriter } from 'vscode-jsonrpc/node';
import { LanguageClient, LanguageClientOptions, MessageTransports } from 'vscode-languageclient/node';
import { ErrorCode, Message } from './protocol';
import { RequestTap, WarmspecSession, formatStatus, summary } from './session';

let client: LanguageClient | undefined;
let session: WarmspecSession | undefined;
let server: ChildProcess | undefined;
let answers: vscode.OutputChannel;
let log: vscode.LogOutputChannel;
let asking: vscode.CancellationTokenSource | undefined;

function config() {
  return vscode.workspace.getConfiguration('warmspec');
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  answers = vscode.window.createOutputChannel('warmspec');
  log = vscode.window.createOutputChannel('warmspec server', { log: true });
  context.subscriptions.push(
    answers,
    log,
    vscode.commands.registerCommand('warmspec.ask', ask),
    vscode.commands.registerCommand('warmspec.cancel', () => asking?.cancel()),
    vscode.commands.registerCommand('warmspec.status', showStatus),
    vscode.commands.registerCommand('warmspec.restart', restart),
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (e.affectsConfiguration('warmspec.server') || e.affectsConfiguration('warmspec.inlineCompletion.maxTokens')) {
        await restart();
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
      inlineCompletion: { maxTokens: config().get<number>('inlineCompletion.maxTokens', 48) },
    },
    outputChannel: log,
    middleware: {
      provideInlineCompletionItems: (document, position, ctx, token, next) =>
        config().get<boolean>('inlineCompletion.enabled', true) ? next(document, position, ctx, token) : undefined,
    },
  };
  client = new LanguageClient('warmspec', 'warmspec', serverOptions, clientOptions);
  try {
    await client.start();
  } catch (err) {
    vscode.window.showErrorMessage(`warmspec: ${errorText(err)}`);
  }
}

async function stop(): Promise<void> {
  asking?.cancel();
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
