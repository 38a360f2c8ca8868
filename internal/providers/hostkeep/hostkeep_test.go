package hostkeep

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func TestIDs(t *testing.T) {
	id := NewID("vm-")
	if !ValidID(id, "vm-") || ValidID(id, "sb-") || ValidID("vm-ABCDEF0123456789", "vm-") || ValidID("vm-123", "vm-") {
		t.Fatalf("ValidID disagrees with NewID (%s) or accepts a bad id", id)
	}
	if got, ok := RetiringID(".retiring-"+id+"-"+NewID(""), "vm-"); !ok || got != id {
		t.Fatalf("RetiringID: %q %v", got, ok)
	}
	for _, name := range []string{id, ".retiring-x", ".retiring-sb-0123456789abcdef-1"} {
		if _, ok := RetiringID(name, "vm-"); ok {
			t.Fatalf("RetiringID took %q", name)
		}
	}
	if !MatchLabels(map[string]string{"a": "1", "b": "2"}, map[string]string{"a": "1"}) || MatchLabels(map[string]string{"a": "1"}, map[string]string{"a": "2"}) || !MatchLabels(nil, nil) {
		t.Fatal("MatchLabels")
	}
}

// Of many concurrent retires of one directory, one does the work.
func TestRetireOnce(t *testing.T) {
	parent := t.TempDir()
	id := NewID("sb-")
	dir := filepath.Join(parent, id)
	if err := os.MkdirAll(filepath.Join(dir, "x"), 0o700); err != nil {
		t.Fatal(err)
	}
	var kills, done atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, err := Retire(dir, id, func(string) { kills.Add(1) })
			if err != nil {
				t.Error(err)
			}
			if ok {
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	if kills.Load() != 1 || done.Load() != 1 {
		t.Fatalf("%d kills, %d retires, want 1 and 1", kills.Load(), done.Load())
	}
	if ents, _ := os.ReadDir(parent); len(ents) != 0 {
		t.Fatalf("left: %v", ents)
	}
}

// Loop: SIGHUP re-reads the expiry (moved earlier here), the expiry kills
// after writing the expired mark; SIGTERM kills at once; an exit of the
// sandbox on its own is an error.
func TestLoop(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	dir := t.TempDir()
	mark := filepath.Join(dir, "expired")
	sigs := make(chan os.Signal, 1)
	exited := make(chan error, 1)
	var reason string
	kill := func(r string) { reason = r }
	soon := time.Now().Add(50 * time.Millisecond)
	sigs <- syscall.SIGHUP
	start := time.Now()
	if err := Loop("x", time.Now().Add(time.Hour), func() (time.Time, error) { return soon, nil }, sigs, exited, kill, mark, "log", log); err != nil {
		t.Fatal(err)
	}
	if reason != "expired" || time.Since(start) > 30*time.Second {
		t.Fatalf("reason %q after %s", reason, time.Since(start))
	}
	if _, err := os.Stat(mark); err != nil {
		t.Fatalf("no expired mark: %v", err)
	}
	sigs <- syscall.SIGTERM
	if err := Loop("x", time.Now().Add(time.Hour), nil, sigs, exited, kill, mark, "log", log); err != nil || reason != "asked to stop" {
		t.Fatalf("SIGTERM: %v %q", err, reason)
	}
	exited <- nil
	if err := Loop("x", time.Now().Add(time.Hour), nil, sigs, exited, kill, mark, "log", log); err == nil {
		t.Fatal("a sandbox that ended on its own is no error")
	}
	exited <- errors.New("wait failed")
	if err := Loop("x", time.Now().Add(time.Hour), nil, sigs, exited, kill, mark, "log", log); err == nil || err.Error() != "wait failed" {
		t.Fatalf("a wait error: %v", err)
	}
}
