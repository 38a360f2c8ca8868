package local

import (
	"path/filepath"

	"stasis/internal/providers/hostkeep"
)

// Crash kills every sandbox under state directory home the way a machine
// crash would: SIGKILL to each sandbox's init, bubblewrap and keeper, with
// no clean shutdown and nothing written; their directories stay as a crash
// leaves them. It returns how many sandboxes it killed. It is for tests and
// for `stasis run --crash`.
func Crash(home string) (int, error) {
	return hostkeep.Crash(filepath.Join(home, "sandboxes", Name), func(dir string) bool {
		return killAt(dir)
	})
}
