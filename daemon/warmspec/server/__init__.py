"""The daemon: a scheduler in front of one warm engine, and the transports that feed it
(JSON-RPC with LSP framing over stdio, a Unix socket and TCP; HTTP for OpenAI and Anthropic clients).
Data flows one way: transport -> scheduler -> engine -> drafters/cache."""
