// Package clients holds the tests that run real third-party OpenAI clients
// — the official openai npm SDK and the Codex CLI, pinned and installed by
// `make deps-clients` into .tools/npm — against the scripted model directly
// and through relay → gateway → model, and check that what a client parses
// through the relay is what it parses from the model itself. It has no code
// besides this doc and the tests' small shared helpers.
package clients
