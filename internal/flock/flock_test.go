package flock

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// tryExclusive reports whether an exclusive lock on path could be taken
// now, from a descriptor of its own (as another process would).
func tryExclusive(t *testing.T, path string) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if errors.Is(err, unix.EWOULDBLOCK) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

// Shared locks exclude an exclusive one until both are released; an
// exclusive one excludes everyone; a lock in a missing directory fails.
func TestLock(t *testing.T) {
	p := filepath.Join(t.TempDir(), "lock")
	un1, err := Lock(p, false)
	if err != nil {
		t.Fatal(err)
	}
	un2, err := Lock(p, false) // shared locks do not wait for each other
	if err != nil {
		t.Fatal(err)
	}
	if tryExclusive(t, p) {
		t.Fatal("an exclusive lock was free while shared ones were held")
	}
	un1()
	if tryExclusive(t, p) {
		t.Fatal("an exclusive lock was free while a shared one was held")
	}
	un2()
	un, err := Lock(p, true)
	if err != nil {
		t.Fatal(err)
	}
	if tryExclusive(t, p) {
		t.Fatal("a second exclusive lock was free")
	}
	un()
	if !tryExclusive(t, p) {
		t.Fatal("the lock stayed held after its release")
	}
	if _, err := Lock(filepath.Join(p, "no", "such"), true); err == nil {
		t.Fatal("a lock in a missing directory succeeded")
	}
}
