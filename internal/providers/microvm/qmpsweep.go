package microvm

import (
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// staleQMPAge is how old a QMP socket must be before sweepQMP may remove
// it: QEMU binds the socket a moment before it listens on it, and a
// connection in that moment is refused too.
const staleQMPAge = time.Minute

// sweepQMP removes the QMP sockets in /tmp whose QEMU is gone: sockets
// older than staleQMPAge that refuse a connection (a live QEMU's listener
// accepts one, at least into its backlog). They are left by a QEMU killed
// with no one to clean up after it — a crash, or a test whose state
// directory was removed after a kill — and no GC of the state directory
// they belonged to can remove them any more. The sockets are shared by
// every state directory on the host, so only dead ones are touched.
// It returns how many it removed.
func sweepQMP(now time.Time) int {
	paths, err := filepath.Glob(qmpPath("vm-*"))
	if err != nil {
		return 0
	}
	n := 0
	for _, p := range paths {
		st, err := os.Lstat(p)
		if err != nil || st.Mode().Type() != os.ModeSocket || now.Sub(st.ModTime()) < staleQMPAge {
			continue
		}
		c, err := net.DialTimeout("unix", p, time.Second)
		if err == nil {
			c.Close()
			continue
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			continue
		}
		if err := os.Remove(p); err == nil {
			n++
		}
	}
	if n > 0 {
		slog.Info("QMP sockets of ended machines removed", "sockets", n)
	}
	return n
}
