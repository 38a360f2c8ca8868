package microvm

import (
	"path/filepath"

	"stasis/internal/providers/hostkeep"
)

// Crash kills every microVM under state directory home the way a machine
// crash would: SIGKILL to each QEMU and its keeper, nothing saved or
// written; their directories stay as a crash leaves them (GC removes them).
// Snapshots, stored apart, survive. It returns how many it killed. It is
// for tests and for `stasis run --crash`.
func Crash(home string) (int, error) {
	return hostkeep.Crash(filepath.Join(home, "sandboxes", Name), func(dir string) bool {
		k, ok := hostkeep.KeeperAt[keeperInfo](dir)
		if ok {
			killVM(k)
		}
		return ok
	})
}
