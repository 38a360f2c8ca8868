// Package bwrap owns what bubblewrap command lines stasis builds have in
// common: a root made of read-only binds of the host's top-level entries.
package bwrap

import "os"

// HostRoot is bubblewrap's arguments that bind every top-level entry of the
// host's root read-only into the sandbox's own root (symlinks recreated as
// symlinks), leaving out /proc, /dev and the paths in skip: the caller
// mounts its own there.
func HostRoot(skip ...string) ([]string, error) {
	ents, err := os.ReadDir("/")
	if err != nil {
		return nil, err
	}
	left := map[string]bool{"/proc": true, "/dev": true}
	for _, s := range skip {
		left[s] = true
	}
	var args []string
	for _, e := range ents {
		p := "/" + e.Name()
		if left[p] {
			continue
		}
		if e.Type()&os.ModeSymlink != 0 {
			t, err := os.Readlink(p)
			if err != nil {
				continue
			}
			args = append(args, "--symlink", t, p)
			continue
		}
		args = append(args, "--ro-bind", p, p)
	}
	return args, nil
}
