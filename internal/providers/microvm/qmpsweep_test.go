package microvm_test

import (
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"stasis/internal/providers/microvm"
)

// GC removes the QMP sockets in /tmp whose QEMU is gone (a machine
// killed with no one to clean up, such as a test that removed its state
// directory after a crash), and nothing else: not a live listener's
// socket, not a dead one too new to tell from a QEMU that has bound but
// not yet listened, not a file that is not a socket.
func TestGCSweepsDeadQMPSockets(t *testing.T) {
	p := newProvider(t, microvm.Options{})
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	name := func(what string) string {
		return filepath.Join("/tmp", "stasis-qmp-vm-sweep"+hex.EncodeToString(b)+what+".sock")
	}
	old := time.Now().Add(-2 * time.Hour)
	listen := func(path string, keep bool) {
		t.Helper()
		ln, err := net.Listen("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close(); os.Remove(path) })
		if !keep {
			ln.(*net.UnixListener).SetUnlinkOnClose(false)
			ln.Close()
		}
	}
	dead, live, fresh, file := name("dead"), name("live"), name("fresh"), name("file")
	listen(dead, false)
	listen(live, true)
	listen(fresh, false)
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(file) })
	for _, f := range []string{dead, live, file} {
		if err := os.Chtimes(f, old, old); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := p.GC(ctx); err != nil {
		t.Fatal(err)
	}
	for f, want := range map[string]bool{dead: false, live: true, fresh: true, file: true} {
		_, err := os.Lstat(f)
		if got := err == nil; got != want {
			t.Errorf("%s: present %v after GC, want %v (%v)", filepath.Base(f), got, want, err)
		}
	}
}
