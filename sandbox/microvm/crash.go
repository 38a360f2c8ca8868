package microvm

import (
	"os"
	"path/filepath"
)

// Crash kills every microVM under state directory home the way a machine
// crash would: SIGKILL to each QEMU and its keeper, nothing saved or
// written; their directories stay as a crash leaves them (GC removes them).
// Snapshots, stored apart, survive. It returns how many it killed. It is
// for tests and for `stasis run --crash`.
func Crash(home string) (int, error) {
	dir := filepath.Join(home, "sandboxes", Name)
	ents, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		if k, ok := readKeeperAt(filepath.Join(dir, e.Name())); ok {
			killVM(k)
			n++
		}
	}
	return n, nil
}
