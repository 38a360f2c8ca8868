// Package bwrap owns what bubblewrap command lines stasis builds have in
// common: the roots sandboxes see of the host, either every top-level entry
// (HostRoot, for stasis's own trusted builds) or only what a userland needs
// (SystemRoot, for sandboxes that hold an agent).
package bwrap

import (
	"os"
	"path/filepath"
	"sort"
)

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
		args = append(args, bindEntry(p, e.Type())...)
	}
	return args, nil
}

func bindEntry(p string, t os.FileMode) []string {
	if t&os.ModeSymlink != 0 {
		tg, err := os.Readlink(p)
		if err != nil {
			return nil
		}
		return []string{"--symlink", tg, p}
	}
	return []string{"--ro-bind", p, p}
}

// System is the allow-list of host paths a sandbox's userland is made of:
// programs, libraries and their configuration. The Go and Node toolchains
// the tasks use live under /usr (/usr/local/go, /usr/bin/node). Nothing
// else of the host is seen: not /root, /home, /var, /run, /srv, /mnt, /opt
// or /tmp, not any state directory, and not the task and repository files
// a server was given.
var System = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"}

// Secrets are the paths under /etc a sandbox never sees, even where the
// host's modes would let it read them: password hashes, host keys, private
// TLS keys, sudo's rules, Kerberos keytabs. A file is covered by an empty
// one, a directory by an empty read-only one.
var Secrets = []string{
	"/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/security/opasswd",
	"/etc/ssh", "/etc/ssl/private", "/etc/sudoers", "/etc/sudoers.d", "/etc/krb5.keytab",
	"/etc/machine-id", "/etc/docker", "/etc/containerd", "/etc/stasis",
}

// SystemRoot is bubblewrap's arguments for a sandbox root made of the
// allow-list System (the entries the host has, symlinks recreated as
// symlinks) plus extra host paths, each bound read-only at the same path,
// with Secrets covered. /proc and /dev are the caller's.
func SystemRoot(extra ...string) []string {
	var args []string
	seen := map[string]bool{}
	paths := append(append([]string{}, System...), extra...)
	for _, p := range paths {
		p = filepath.Clean(p)
		if seen[p] || p == "/" || !filepath.IsAbs(p) {
			continue
		}
		seen[p] = true
		fi, err := os.Lstat(p)
		if err != nil {
			continue
		}
		args = append(args, bindEntry(p, fi.Mode().Type())...)
	}
	secrets := append([]string{}, Secrets...)
	sort.Strings(secrets) // parents before children
	for _, s := range secrets {
		fi, err := os.Lstat(s)
		if err != nil || fi.Mode()&os.ModeSymlink != 0 {
			continue
		}
		if fi.IsDir() {
			args = append(args, "--tmpfs", s, "--remount-ro", s)
		} else {
			args = append(args, "--ro-bind", "/dev/null", s)
		}
	}
	return args
}
