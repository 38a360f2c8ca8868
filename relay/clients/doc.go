// Package clients holds the tests that run real third-party OpenAI
// clients — the openai npm SDK and the Codex CLI — against the scripted
// model directly and through relay → gateway → model. It has no code of
// its own; `make deps-clients` installs the clients into .tools/npm.
package clients
