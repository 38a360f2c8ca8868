package microvm

import (
	"os"
	"path/filepath"

	"stasis/internal/providers/hostkeep"
)

// Crash kills every microVM under state directory home the way a machine
// crash would: SIGKILL to each QEMU and its keeper, nothing saved or
// written; their directories stay as a crash leaves them (GC removes them),
// but each one's QMP socket in /tmp, useless once QEMU is gone, is removed
// with it, so a test that removes the state directory leaves none behind.
// Snapshots, stored apart, survive. It returns how many it killed. It is
// for tests and for `stasis run --crash`.
func Crash(home string) (int, error) {
	return hostkeep.Crash(filepath.Join(home, "sandboxes", Name), func(dir string) bool {
		k, ok := hostkeep.KeeperAt[keeperInfo](dir)
		if ok {
			killVM(k)
			_ = os.Remove(qmpPath(filepath.Base(dir)))
		}
		return ok
	})
}
