// Package providers owns the list of stasis's built-in sandbox providers:
// importing it registers every one (local, microvm, e2b, opensandbox) with
// sandbox.Register, so that sandbox.Open knows them by name. The CLI, the
// server and the job import it; a program that wants fewer imports only
// the providers it uses.
package providers

import (
	// Each registers itself in its init.
	_ "stasis/sandbox/e2b"
	_ "stasis/sandbox/local"
	_ "stasis/sandbox/microvm"
	_ "stasis/sandbox/opensandbox"
)
