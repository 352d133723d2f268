// warmspec's JSON-RPC wire types, as TypeScript. The source of truth is
// protocol/warmspec_protocol/rpc.py (msgspec Structs) and types.py; keep these in step with them.
// warmspec/* params and results are snake_case; what lives inside LSP messages is camelCase.

export type RequestId = number | string;

export const enum ErrorCode {
  ParseError = -32700,
  InvalidRequest = -32600,
  MethodNotFound = -32601,
  InvalidParams = -32602,
  InternalError = -32603,
  ServerNotInitialized = -32002,
  RequestCancelled = -32800,
  ContentModified = -32801, // a newer inline completion, or an edit, of the same document replaced this one
  Unauthorized = -31001,
  PathRefused = -31002,
  Busy = -31003,
}

export interface Message {
  role: 'system' | 'user' | 'assistant' | 'tool';
  content: string;
  name?: string;
}

export interface GenerateOptions {
  max_tokens?: number | null;
  stop?: string | string[] | null;
  temperature?: number | null;
  top_p?: number | null;
  top_k?: number | null;
  min_p?: number | null;
  seed?: number | null;
  speculate?: boolean;
  conversation?: string | null;
}

export interface ChatParams extends GenerateOptions {
  messages: Message[];
}

export interface CompleteParams extends GenerateOptions {
  prompt: string;
}

/** `warmspec/delta`: text that became final for the request `id`. */
export interface DeltaParams {
  id: RequestId;
  text: string;
  tokens: number;
}

export interface GenerationStats {
  prompt_tokens: number;
  cached_tokens: number;
  completion_tokens: number;
  prefill_s: number;
  decode_s: number;
  passes: number;
  drafted: number;
  accepted: number;
  gated_steps: number;
}

export type FinishReason = 'stop' | 'length' | 'cancelled' | 'error';

export interface GenerateResult {
  text: string;
  finish_reason: FinishReason;
  stats: GenerationStats;
  tok_s: number;
  ttft_s: number;
}

export interface ModelInfo {
  id: string;
  source: string;
  device: string;
  quantized: boolean;
  context_length: number | null;
  parameters_bytes: number;
}

/** What became of a document's or a language's suggestions (editors' feedback). */
export interface Acceptance {
  shown: number;
  accepted: number;
  partial: number;
  dismissed: number;
  chars_shown: number;
  chars_accepted: number;
}

export interface Latency {
  count: number;
  p50_ms: number;
  p90_ms: number;
}

export interface InlineStatus {
  requests: number;
  cache_hits: number;
  cancelled: number;
  deadline: number;
  first_visible: Latency;
  final: Latency;
  tokens_generated: number;
  tokens_thrown_away: number;
  next_edits: number;
  alternatives: number;
  prefetched: number;
  prefetch_attached: number;
  acceptance: Acceptance;
  documents: Record<string, Acceptance>;
  languages: Record<string, Acceptance>;
}

export interface Status {
  model: ModelInfo;
  blas: string;
  uptime_s: number;
  queue: number;
  active: boolean;
  requests_completed: number;
  requests_failed: number;
  totals: GenerationStats;
  workspace_files: number;
  workspace_bytes: number;
  inline?: InlineStatus;
}

export interface ModelsResult {
  models: ModelInfo[];
  requested: string | null;
}

export interface DidReadParams {
  path: string;
  text?: string | null;
  conversation?: string | null;
}

export interface DidReadResult {
  path: string;
  workspace_files: number;
}

/** `initialize`'s `initializationOptions` (camelCase: it lives inside an LSP message). */
export interface InlineCompletionSettings {
  prefixChars?: number;
  suffixChars?: number;
  maxTokens?: number;
  /** Partial suggestions (`warmspec/inlineCompletionPartial`) and timings in the result. */
  stream?: boolean;
  deadlineMs?: number | null;
  debounceMs?: number;
  adapt?: boolean;
  /** Start the suggestion at a typing `didChange`, before the request (more model time). */
  prefetch?: boolean;
}

export interface InitializationOptions {
  apiKey?: string;
  inlineCompletion?: InlineCompletionSettings;
}

// The LSP 3.18 inline completion types this client uses.
export interface Position {
  line: number;
  character: number;
}

export interface Range {
  start: Position;
  end: Position;
}

export interface InlineCompletionItem {
  insertText: string | { kind: 'snippet'; value: string };
  filterText?: string;
  range?: Range;
}

export interface InlineCompletionList {
  items: InlineCompletionItem[];
}

export const enum InlineCompletionTriggerKind {
  Invoked = 1,
  Automatic = 2,
}

/** `warmspec/inlineCompletionPartial`: the suggestion so far (all of it, not a delta). */
export interface InlineCompletionPartialParams {
  id: RequestId;
  uri: string;
  position: Position;
  text: string;
}

/** The `warmspec` field of a streaming client's inline completion result. */
export interface InlineCompletionInfo {
  firstVisibleMs: number | null;
  finalMs: number;
  tokens: number;
  finish: 'stop' | 'length' | 'deadline' | 'cache' | 'empty';
  maxTokens: number;
  debounceMs: number;
}

export interface InlineCompletionResult {
  items: InlineCompletionItem[];
  warmspec?: InlineCompletionInfo;
}

export type FeedbackEvent = 'shown' | 'accepted' | 'partial' | 'dismissed';

export interface InlineCompletionFeedbackParams {
  id: RequestId;
  event: FeedbackEvent;
  accepted_chars?: number;
  index?: number;
}

export interface AlternativesParams {
  uri: string;
  position: Position;
  count?: number;
  temperature?: number;
  seed?: number;
}

export interface Alternative {
  text: string;
  seed: number | null;
}

export interface AlternativesResult {
  items: Alternative[];
  range: Range;
}

export interface NextEditParams {
  uri: string;
  position: Position;
}

export interface NextEdit {
  range: Range;
  text: string;
  kind: 'rename' | 'repeat';
  old: string;
  new: string;
  remaining: number;
}

export interface NextEditResult {
  edit: NextEdit | null;
}
