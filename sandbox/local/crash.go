package local

import (
	"os"
	"path/filepath"
)

// Crash kills every sandbox under state directory home the way a machine
// crash would: SIGKILL to each sandbox's init, bubblewrap and keeper, with
// no clean shutdown and nothing written; their directories stay as a crash
// leaves them. It returns how many sandboxes it killed. It is for tests and
// for `stasis run --crash`.
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
			killSandbox(k)
			n++
		}
	}
	return n, nil
}
