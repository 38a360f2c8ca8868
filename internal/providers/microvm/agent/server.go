package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/guestclock"
	"stasis/internal/proc"
	"stasis/sandbox"
)

// bootIDPath holds the kernel's random id of the current boot.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// server holds what the handlers share.
type server struct {
	log   *slog.Logger
	users *Users // nil: every command and file is the agent's own user's
	// clocks reads and sets the system's clocks; tests replace it.
	clocks guestclock.Clocks

	mu     sync.Mutex
	active int           // handlers running
	closed bool          // no new handler may start
	idle   chan struct{} // closed when closed and active reaches 0
}

// Serve runs the agent on ln until ctx ends, then closes ln and every
// connection, kills the foreground commands still running (background
// commands go on), and returns once every handler has returned. It returns
// nil after ctx ends, or the error that stopped it serving. A nil log
// discards the log. Every command and file is the agent's own user's.
func Serve(ctx context.Context, ln net.Listener, log *slog.Logger) error {
	return ServeConfig(ctx, ln, Config{Log: log})
}

// ServeConfig is Serve with the users split and connections from the
// guest refused as c says.
func ServeConfig(ctx context.Context, ln net.Listener, c Config) error {
	log := c.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if c.Users != nil {
		if err := c.Users.Check(); err != nil {
			return err
		}
	}
	if c.HostOnly {
		ln = hostOnly{Listener: ln, log: log}
	}
	s := newServer(log)
	s.users = c.Users
	srv := &http.Server{
		Handler: s.handler(),
		// Requests end with ctx: foreground commands are killed.
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ReadHeaderTimeout: 30 * time.Second,
		// A connection that broke at a snapshot may look idle forever.
		IdleTimeout: 2 * time.Minute,
		ErrorLog:    slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	log.Info("agent serving", "addr", ln.Addr().String(), "pid", os.Getpid(), "users_split", c.Users != nil, "host_only", c.HostOnly)
	err := srv.Serve(ln)
	_ = srv.Close()
	s.drain()
	if ctx.Err() != nil && errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

func newServer(log *slog.Logger) *server {
	return &server{
		log:    log,
		clocks: guestclock.System,
		idle:   make(chan struct{}),
	}
}

func (s *server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/health", s.health)
	mux.HandleFunc("GET /v1/info", s.info)
	mux.HandleFunc("POST /v1/clock", s.clock)
	mux.HandleFunc("POST /v1/exec", s.exec)
	mux.HandleFunc("GET /v1/file", s.readFile)
	mux.HandleFunc("PUT /v1/file", s.writeFile)
	mux.HandleFunc("PUT /v1/tar", s.upload)
	mux.HandleFunc("GET /v1/tar", s.download)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.enter() {
			writeError(w, errors.New("the agent is shutting down"))
			return
		}
		defer s.leave()
		s.log.Debug("request", "method", r.Method, "path", r.URL.Path, "query", r.URL.RawQuery)
		mux.ServeHTTP(w, r)
	})
}

func (s *server) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.active++
	return true
}

func (s *server) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active--
	if s.closed && s.active == 0 {
		close(s.idle)
	}
}

// drain stops new handlers and waits for the running ones.
func (s *server) drain() {
	s.mu.Lock()
	s.closed = true
	if s.active == 0 {
		close(s.idle)
	}
	s.mu.Unlock()
	<-s.idle
}

// writeError answers with err's status and a JSON body of its kind and
// message.
func writeError(w http.ResponseWriter, err error) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(errdefs.HTTPStatus(err))
	_ = json.NewEncoder(w).Encode(toWire(err))
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// drainBody reads what is left of a request body, so that the client,
// still sending, sees the answer rather than a broken connection.
func drainBody(r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
}

func (s *server) health(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, map[string]bool{"ok": true})
}

// Info is what GET /v1/info reports about the guest.
type Info struct {
	// Wall is the guest's wall clock, Unix seconds.
	Wall float64 `json:"wall"`
	// Uptime is seconds since the guest booted (/proc/uptime); it continues
	// across a snapshot and restore.
	Uptime float64 `json:"uptime"`
	// BootID is /proc/sys/kernel/random/boot_id: it changes when the guest
	// reboots, not when it is restored.
	BootID string `json:"boot_id"`
	// PID is the agent's process id.
	PID int `json:"pid"`
}

// WallTime is Wall as a time.Time.
func (i Info) WallTime() time.Time { return unixFloat(i.Wall) }

func unixFloat(f float64) time.Time {
	sec := math.Floor(f)
	return time.Unix(int64(sec), int64(math.Round((f-sec)*1e9)))
}

func (s *server) info(w http.ResponseWriter, _ *http.Request) {
	boot, err := os.ReadFile(bootIDPath)
	if err != nil {
		writeError(w, err)
		return
	}
	// The two clocks are read back to back, so that a reader can compare
	// them (the clock policy's checks).
	up, err := proc.Uptime()
	if err != nil {
		writeError(w, err)
		return
	}
	now := time.Now()
	writeJSON(w, Info{
		Wall:   float64(now.Unix()) + float64(now.Nanosecond())/1e9,
		Uptime: up, BootID: strings.TrimSpace(string(boot)), PID: os.Getpid(),
	})
}

// clock sets the guest's wall clock to the target in the body (a
// guestclock.Target), computed here from the guest's own uptime, and
// answers with what it did (a guestclock.Fix).
func (s *server) clock(w http.ResponseWriter, r *http.Request) {
	var t guestclock.Target
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<16))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&t); err != nil {
		writeError(w, sandbox.Errorf(errdefs.ErrInvalid, "clock", "", "bad body: %v", err))
		return
	}
	if err := t.Check(); err != nil {
		writeError(w, sandbox.Errorf(errdefs.ErrInvalid, "clock", "", "%v", err))
		return
	}
	f, err := s.clocks.Set(t)
	if err != nil {
		kind := errdefs.ErrInvalid
		if errors.Is(err, guestclock.ErrNotPermitted) {
			kind = errdefs.ErrUnsupported
		}
		writeError(w, sandbox.Errorf(kind, "clock", "", "%v", err))
		return
	}
	s.log.Info("clock set", "to", f.After, "was", f.Before, "uptime", f.Uptime, "continuous", t.Continuous)
	writeJSON(w, f)
}
