// Package providers owns the list of stasis's built-in sandbox providers:
// importing it registers every one (local, microvm, e2b, opensandbox, and
// sim, the simulated provider for benchmarks and tests of stasis itself) with
// sandbox.Register, so that sandbox.Open knows them by name. The CLI, the
// server and the job import it; a program that wants fewer imports only
// the providers it uses.
package providers

import (
	// Each registers itself in its init.
	_ "stasis/internal/providers/e2b"
	_ "stasis/internal/providers/local"
	_ "stasis/internal/providers/microvm"
	_ "stasis/internal/providers/opensandbox"
	_ "stasis/internal/providers/sim"
)
