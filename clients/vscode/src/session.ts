// warmspec's JSON-RPC methods on top of any LSP connection: vscode-languageclient's LanguageClient
// in the extension, a plain vscode-jsonrpc MessageConnection in tests and scripts. No `vscode`
// import here, so all of it runs in plain Node.
//
// The one thing a JSON-RPC library does not give a caller is the id of a request it sent, and
// `warmspec/delta` notifications name their request only by that id. So the writer is tapped
// (RequestTap): when the request goes out, its params object (the very object the caller passed)
// is matched to the id, and the request's delta callback is filed under it -- before the server
// can have answered anything.

import { ChildProcess, spawn, SpawnOptions } from 'child_process';
import {
  CancellationToken,
  Disposable,
  Message as RpcMessage,
  MessageConnection,
  MessageWriter,
  RequestMessage,
  StreamMessageReader,
  StreamMessageWriter,
  createMessageConnection,
} from 'vscode-jsonrpc/node';
import type {
  AlternativesParams,
  AlternativesResult,
  ChatParams,
  CompleteParams,
  DeltaParams,
  DidReadParams,
  DidReadResult,
  GenerateResult,
  InitializationOptions,
  InlineCompletionFeedbackParams,
  InlineCompletionItem,
  InlineCompletionList,
  InlineCompletionPartialParams,
  InlineCompletionResult,
  ModelsResult,
  NextEditParams,
  NextEditResult,
  Position,
  RequestId,
  Status,
} from './protocol';
import { InlineCompletionTriggerKind } from './protocol';

/** What a LanguageClient and a MessageConnection both offer. */
export interface Rpc {
  sendRequest<R>(method: string, param: any, token?: CancellationToken): Promise<R>;
  sendNotification(method: string, params?: any): Promise<void>;
  onNotification(method: string, handler: (params: any) => void): Disposable;
}

/** A MessageWriter that reports each request it writes, then writes it. */
export class RequestTap implements MessageWriter {
  private claims = new Map<object, (id: RequestId) => void>();

  constructor(private readonly inner: MessageWriter) {}

  /** Call `onId` with the id of the request whose params are `params`, when it is written. */
  claim(params: object, onId: (id: RequestId) => void): void {
    this.claims.set(params, onId);
  }

  release(params: object): void {
    this.claims.delete(params);
  }

  get onError() {
    return this.inner.onError;
  }

  get onClose() {
    return this.inner.onClose;
  }

  write(msg: RpcMessage): Promise<void> {
    if (RpcMessage.isRequest(msg)) {
      const params = (msg as RequestMessage).params;
      const onId = params && typeof params === 'object' ? this.claims.get(params) : undefined;
      if (onId) {
        this.claims.delete(params as object);
        onId((msg as RequestMessage).id as RequestId);
      }
    }
    return this.inner.write(msg);
  }

  end(): void {
    this.inner.end();
  }

  dispose(): void {
    this.inner.dispose();
  }
}

export type DeltaHandler = (delta: DeltaParams) => void;
export type PartialHandler = (partial: InlineCompletionPartialParams) => void;

/** warmspec's methods over an Rpc whose writer is `tap`. */
export class WarmspecSession {
  private streams = new Map<RequestId, DeltaHandler>();
  private partials = new Map<RequestId, PartialHandler>();
  private subscriptions: Disposable[];

  constructor(private readonly rpc: Rpc, private readonly tap: RequestTap) {
    this.subscriptions = [
      rpc.onNotification('warmspec/delta', (params: DeltaParams) => {
        this.streams.get(params.id)?.(params);
      }),
      rpc.onNotification('warmspec/inlineCompletionPartial', (params: InlineCompletionPartialParams) => {
        this.partials.get(params.id)?.(params);
      }),
    ];
  }

  /** A chat answer; `onDelta` gets its text as it is decoded. Cancelling `token` sends
   * `$/cancelRequest` (the promise then rejects with code RequestCancelled). */
  chat(params: ChatParams, onDelta?: DeltaHandler, token?: CancellationToken): Promise<GenerateResult> {
    return this.stream('warmspec/chat', params, onDelta, token);
  }

  /** A raw-prompt completion, streamed like chat. */
  complete(params: CompleteParams, onDelta?: DeltaHandler, token?: CancellationToken): Promise<GenerateResult> {
    return this.stream('warmspec/complete', params, onDelta, token);
  }

  status(): Promise<Status> {
    return this.request('warmspec/status', {});
  }

  models(): Promise<ModelsResult> {
    return this.request('warmspec/models', {});
  }

  /** Report a file an agent read (outside the daemon's workspace: an error, code PathRefused). */
  didRead(params: DidReadParams): Promise<DidReadResult> {
    return this.request('warmspec/didRead', params);
  }

  /** Ghost text at `position` of an open document; null when the server has none. */
  async inlineCompletion(uri: string, position: Position, token?: CancellationToken,
                         triggerKind = InlineCompletionTriggerKind.Invoked): Promise<InlineCompletionItem[]> {
    const result = await this.request<InlineCompletionList | InlineCompletionItem[] | null>(
      'textDocument/inlineCompletion', { textDocument: { uri }, position, context: { triggerKind } }, token);
    if (!result) {
      return [];
    }
    return Array.isArray(result) ? result : result.items;
  }

  /** Ghost text that grows as it decodes: `onPartial` gets each partial suggestion (the server
   * sends them when the connection was initialized with `inlineCompletion.stream`), `onId` the
   * request's id as it goes out; the result is LSP's list with the `warmspec` timings. Cancelling
   * `token` sends `$/cancelRequest`. */
  async inlineCompletionStream(uri: string, position: Position, onPartial: PartialHandler,
                               options: { token?: CancellationToken; deadlineMs?: number | null;
                                          triggerKind?: InlineCompletionTriggerKind;
                                          onId?: (id: RequestId) => void } = {}): Promise<InlineCompletionResult> {
    const params: Record<string, unknown> = {
      textDocument: { uri }, position,
      context: { triggerKind: options.triggerKind ?? InlineCompletionTriggerKind.Automatic },
    };
    if (options.deadlineMs) {
      params.warmspec = { deadlineMs: options.deadlineMs };
    }
    let id: RequestId | undefined;
    this.tap.claim(params, (requestId) => {
      id = requestId;
      this.partials.set(requestId, onPartial);
      options.onId?.(requestId);
    });
    try {
      const result = await this.request<InlineCompletionResult | InlineCompletionItem[] | null>(
        'textDocument/inlineCompletion', params, options.token);
      if (!result) {
        return { items: [] };
      }
      return Array.isArray(result) ? { items: result } : result;
    } finally {
      this.tap.release(params);
      if (id !== undefined) {
        this.partials.delete(id);
      }
    }
  }

  /** What became of a suggestion (`id`: the request that made it). */
  feedback(params: InlineCompletionFeedbackParams): Promise<void> {
    return this.rpc.sendNotification('warmspec/inlineCompletionFeedback', params);
  }

  /** Different suggestions at a place: the greedy one, then seeded samples. `onId`: the
   * request's id, which feedback on an item names (with its index). */
  async alternatives(params: AlternativesParams, onId?: (id: RequestId) => void,
                     token?: CancellationToken): Promise<AlternativesResult> {
    const sent = { ...params };
    if (onId) {
      this.tap.claim(sent, onId);
    }
    try {
      return await this.request('warmspec/alternatives', sent, token);
    } finally {
      this.tap.release(sent);
    }
  }

  /** The edit likely to come next in a document (null: none). */
  nextEdit(params: NextEditParams, token?: CancellationToken): Promise<NextEditResult> {
    return this.request('warmspec/nextEdit', params, token);
  }

  /** A request; the token only when there is one: vscode-jsonrpc would send a trailing
   * `undefined` as a second positional param, turning params into an array. */
  private request<R>(method: string, params: object, token?: CancellationToken): Promise<R> {
    return token ? this.rpc.sendRequest<R>(method, params, token) : this.rpc.sendRequest<R>(method, params);
  }

  dispose(): void {
    this.subscriptions.forEach((s) => s.dispose());
    this.streams.clear();
    this.partials.clear();
  }

  private async stream<P extends object>(method: string, params: P, onDelta: DeltaHandler | undefined,
                                         token: CancellationToken | undefined): Promise<GenerateResult> {
    // A fresh object: the tap matches by identity, and a caller may send one params object twice.
    const sent = { ...params };
    let id: RequestId | undefined;
    this.tap.claim(sent, (requestId) => {
      id = requestId;
      if (onDelta) {
        this.streams.set(requestId, onDelta);
      }
    });
    try {
      return await this.request<GenerateResult>(method, sent, token);
    } finally {
      this.tap.release(sent);
      if (id !== undefined) {
        this.streams.delete(id);
      }
    }
  }
}

/** "32 tokens, 21.4 tok/s, 1.88 tok/pass (17 passes, 24 drafted, 15 accepted), first token 240 ms (stop)" */
export function summary(result: GenerateResult): string {
  const s = result.stats;
  const parts = [`${s.completion_tokens} tokens`, `${result.tok_s.toFixed(1)} tok/s`];
  if (s.passes > 0) {
    parts.push(`${(s.completion_tokens / s.passes).toFixed(2)} tok/pass ` +
               `(${s.passes} passes, ${s.drafted} drafted, ${s.accepted} accepted)`);
  }
  parts.push(`first token ${(result.ttft_s * 1000).toFixed(0)} ms`);
  return `${parts.join(', ')} (${result.finish_reason})`;
}

export function formatStatus(s: Status): string[] {
  const lines = [
    `${s.model.id} on ${s.model.device}${s.model.quantized ? ' (quantized)' : ''}, up ${s.uptime_s.toFixed(0)} s, ${s.blas}`,
    `requests: ${s.requests_completed} done, ${s.requests_failed} failed, ${s.queue} queued` +
      (s.active ? ', one running' : ''),
  ];
  const t = s.totals;
  if (t.completion_tokens > 0) {
    let line = `totals: ${t.completion_tokens} tokens generated`;
    if (t.passes > 0) {
      line += `, ${(t.completion_tokens / t.passes).toFixed(2)} tok/pass, ${t.accepted} of ${t.drafted} drafted accepted`;
    }
    lines.push(line);
  }
  const g = s.inline;
  if (g && g.requests > 0) {
    const a = g.acceptance;
    lines.push(`ghost text: ${g.requests} requests (${g.cancelled} cancelled), first visible ` +
      `${g.first_visible.p50_ms.toFixed(0)} ms, final ${g.final.p50_ms.toFixed(0)} ms (medians); ` +
      `${a.accepted} of ${a.shown} shown accepted, ${a.partial} in part`);
  }
  lines.push(`workspace: ${s.workspace_files} files indexed`);
  return lines;
}

// -- a server of one's own (tests, scripts) -------------------------------------------------------

export interface ServerProcess {
  process: ChildProcess;
  connection: MessageConnection;
  session: WarmspecSession;
  /** `initialize` then `initialized`; resolves with the server's InitializeResult. */
  initialize(options?: InitializationOptions, rootUri?: string | null): Promise<any>;
  /** `shutdown`, `exit`, and the process's exit code. */
  shutdown(): Promise<number | null>;
  /** Resolves with the exit code when the process ends. */
  exited: Promise<number | null>;
}

/** Spawn `command args` (e.g. `warmspec lsp`) and speak JSON-RPC to it on stdio; its stderr (the
 * daemon's log) goes to `onStderr`. */
export function spawnServer(command: string, args: string[], options: SpawnOptions = {},
                            onStderr: (chunk: string) => void = () => {}): ServerProcess {
  const child = spawn(command, args, { ...options, stdio: ['pipe', 'pipe', 'pipe'] });
  child.stderr!.setEncoding('utf8');
  child.stderr!.on('data', onStderr);
  const exited = new Promise<number | null>((resolve) => {
    child.on('exit', (code) => resolve(code));
    child.on('error', (err) => {
      onStderr(`could not start ${command}: ${err.message}\n`);
      resolve(null);
    });
  });
  const tap = new RequestTap(new StreamMessageWriter(child.stdin!));
  const connection = createMessageConnection(new StreamMessageReader(child.stdout!), tap);
  connection.listen();
  const session = new WarmspecSession(connection, tap);
  return {
    process: child,
    connection,
    session,
    exited,
    async initialize(initializationOptions?: InitializationOptions, rootUri: string | null = null) {
      const result = await connection.sendRequest('initialize', {
        processId: process.pid,
        clientInfo: { name: 'warmspec-node' },
        rootUri,
        capabilities: {},
        initializationOptions,
      });
      await connection.sendNotification('initialized', {});
      return result;
    },
    async shutdown() {
      await connection.sendRequest('shutdown');
      await connection.sendNotification('exit');
      const code = await exited;
      session.dispose();
      connection.dispose();
      return code;
    },
  };
}
