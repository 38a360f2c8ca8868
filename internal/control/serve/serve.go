// Package serve owns how stasis's HTTP servers (relay, gateway, scripted
// model) take an address and run: listening on host:port or a unix socket
// (replacing a socket a dead server left, refusing one a live server
// answers on), and serving until SIGTERM or SIGINT with a graceful
// shutdown.
package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// Listen listens on host:port, or on a unix socket given as unix:PATH or
// unix://PATH. It returns the listener and the address to show: host:port
// (with the port chosen for :0), or unix:PATH.
func Listen(addr string) (net.Listener, string, error) {
	path, isUnix := strings.CutPrefix(addr, "unix://")
	if !isUnix {
		path, isUnix = strings.CutPrefix(addr, "unix:")
	}
	if !isUnix {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, "", fmt.Errorf("listen %s: %w", addr, err)
		}
		return ln, ln.Addr().String(), nil
	}
	if path == "" {
		return nil, "", errors.New("listen unix: needs a path, e.g. unix:/tmp/model.sock")
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, "", fmt.Errorf("listen %s: %s exists and is not a socket; remove it or pick another path", addr, path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, "", fmt.Errorf("listen %s: a server already answers on %s", addr, path)
		}
		// The server that left it may remove it meanwhile, as it closes.
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, "", fmt.Errorf("listen %s: removing the stale socket: %w", addr, err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, "", fmt.Errorf("listen %s: %w", addr, err)
	}
	return ln, "unix:" + path, nil
}

// OnSignal is ctx, ended when SIGTERM or SIGINT arrives. A server calls it
// first, before it announces its address: from then on a signal ends it
// through UntilSignal's orderly shutdown, where before the runtime's
// default action would have killed it with its sandboxes left running.
func OnSignal(ctx context.Context) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
}

// UntilSignal serves h on ln until ctx ends, SIGTERM or SIGINT arrives, or
// serving fails; then it shuts down, giving requests under way 10 s before
// closing them. A caller that prints its address before calling it should
// have taken ctx from OnSignal first.
func UntilSignal(ctx context.Context, ln net.Listener, h http.Handler, log *slog.Logger) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second}
	ctx, stop := OnSignal(ctx)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return fmt.Errorf("serving %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	log.Info("shutting down", "addr", ln.Addr().String())
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn("requests still running at shutdown; closing them", "err", err)
		_ = srv.Close()
	}
	return nil
}

// ProcsForFsync raises GOMAXPROCS to four per CPU unless $GOMAXPROCS is
// set, for servers that fsync on their request path (the gateway's ledger
// appends). A goroutine blocked in fsync keeps its P until the runtime's
// monitor takes it back, and the monitor looks only every few milliseconds
// when it is idle; with one P per CPU a gateway then leaves CPUs idle while
// calls wait. More Ps than CPUs let other goroutines run meanwhile. It
// returns the new setting.
func ProcsForFsync() int {
	if os.Getenv("GOMAXPROCS") != "" {
		return runtime.GOMAXPROCS(0)
	}
	n := 4 * runtime.NumCPU()
	runtime.GOMAXPROCS(n)
	return n
}

// StatusRecorder is a ResponseWriter that remembers the status written,
// for a server's metrics and logs. Flush and Unwrap pass through, so a
// stream through it is flushed and http.ResponseController reaches the
// connection.
type StatusRecorder struct {
	http.ResponseWriter
	code int
}

// WriteHeader records the first status written and writes it.
func (r *StatusRecorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

// Write records 200 when no status was written first.
func (r *StatusRecorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

// Flush flushes the underlying writer, when it can.
func (r *StatusRecorder) Flush() {
	if f, ok := r.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap is the underlying writer.
func (r *StatusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// Status is the status written (200 when none was).
func (r *StatusRecorder) Status() int {
	if r.code == 0 {
		return http.StatusOK
	}
	return r.code
}
