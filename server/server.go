// Package server is the environment server (`stasis serve`): an HTTP JSON
// API over a checkpoint coordinator, for trainers. It starts episodes,
// lists, gets, verifies and retires them, takes checkpoints (prepare and
// commit in one call), lists, gets, restores and deletes them, and serves
// Prometheus metrics, liveness and its OpenAPI document
// (openapi/server.json). Who may call it is its Access (auth.go): loopback
// or a unix socket without credentials, the network only with bearer
// tokens or client certificates; the gateway is served only where the
// sandboxes reach it, never on the API.
//
// Everything durable lives in one state directory: the record store
// (store.db), the gateway's episodes and ledgers (gateway/), the local
// provider's sandboxes and snapshots (local/) and the Go build cache seeds
// of verify (verify-seeds/). A server killed and started
// again on the same directory finds its running episodes again (their
// sandboxes keep running while no server is up) and goes on serving them:
// the gateway's unix socket, which relays inside the sandboxes dial, is at
// a path that depends only on the state directory.
package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"stasis/coordinator"
	"stasis/episode"
	"stasis/harness"
	"stasis/internal/sandboxbin"
	"stasis/model"
	"stasis/relay"
	"stasis/sandbox"
	"stasis/sandbox/local"
	"stasis/sandbox/opensandbox"
	_ "stasis/sandbox/providers" // every provider, for sandbox.Open
	"stasis/serve"
	"stasis/store"
	"stasis/supervisor"
	"stasis/task"
	"stasis/task/pyenv"
)

// Options configure a Server.
type Options struct {
	// State is the state directory (made if missing): store.db, gateway/
	// and local/.
	State string
	// Tasks are the tasks episodes may name (default: the built-in set).
	Tasks []*task.Task
	// Envs is the directory where the tasks' Python environments are built
	// (task.SWEBenchOptions.Envs); local sandboxes see it read-only at
	// pyenv.SandboxRoot.
	Envs string
	// ModelUpstream is the model server the gateway forwards to; empty runs
	// the scripted model in-process, on a loopback port, solving Tasks.
	ModelUpstream string
	// ModelKey is sent to ModelUpstream as a bearer token, if set.
	ModelKey string
	// Model is the model name harnesses ask for (default model.DefaultName).
	Model string
	// Concurrency bounds the episodes a checkpoint or a restore works on at
	// once (default 16).
	Concurrency int
	// Exe and ExeEnv: the stasis binary that runs the local provider's
	// keepers, and extra environment for it (default: this executable).
	Exe    string
	ExeEnv []string
	// Binary and BinaryEnv: the stasis binary placed in sandboxes, and the
	// environment it needs there (default: this executable). Tests run
	// their own binary as stasis.
	Binary    string
	BinaryEnv map[string]string
	// Provider names the sandbox provider: local (the default), microvm,
	// or a hosted one: opensandbox or e2b (configured by their
	// environment variables).
	Provider string
	// GuestBinary is the static stasis binary the microvm provider puts in
	// its guest image (default: Binary, which must then be static).
	GuestBinary string
	// GuestMemMiB is each microVM guest's memory (0: the provider's
	// default).
	GuestMemMiB int
	// GatewayListen is a TCP address where the gateway also listens, for
	// hosted sandboxes (e2b, opensandbox), which cannot reach the unix
	// socket; GatewayURL is that listener as their relays reach it
	// (default: http:// and the address bound). Required for hosted
	// providers.
	GatewayListen string
	GatewayURL    string
	// ClockPolicy sets a guest's wall clock after a resume in place:
	// continuous (the default) or host.
	ClockPolicy string
	// GatewayMiddleware, when set, wraps the gateway's handler on the
	// sandboxes' unix socket (tests hold calls there).
	GatewayMiddleware func(http.Handler) http.Handler
	// Limits are the local provider's sandboxes' limits where an episode
	// names none (zero fields: local.DefaultLimits).
	Limits sandbox.Limits
	// Stragglers is what a checkpoint does with an episode that cannot be
	// checkpointed (coordinator.StragglersExclude, the default, or
	// StragglersFail); a request may override it.
	Stragglers string
	// Image is the sandboxes' image where neither the start request nor
	// the task names one (empty: the provider's own root).
	Image string
	// PullImages: a restore pulls a missing image again from the
	// reference its record names (coordinator.Options.PullImages).
	PullImages bool
	// SandboxBinary is the static in-sandbox binary a local sandbox on an
	// image execs through (local.Options.SandboxBinary; default: the
	// lean stasis-sandbox, sandboxbin.Path()).
	SandboxBinary string
	// Access guards the API's handler (NewAccess for its listener);
	// default LoopbackAccess.
	Access *Access
	Logger *slog.Logger
}

// openProvider opens the server's provider (o.Provider, by the registry)
// on its part of the state directory. A host provider's sandboxes each get
// a gateway socket of their own, on which only their episode's token is
// valid; they see nothing of the state directory (every episode's token
// and the record store are there), and they get the stasis binary and,
// when installed, OpenCode read-only (a local sandbox by bind mounts, a
// microVM guest in its image and on an erofs disk). The SWE-bench
// environments are bound into local sandboxes, where their venvs expect
// them.
func (s *Server) openProvider(ctx context.Context, d sandbox.Driver, bin string) (sandbox.Provider, error) {
	o := s.o
	cfg := sandbox.Config{
		Home: filepath.Join(s.state, o.Provider), Exe: o.Exe, ExeEnv: o.ExeEnv,
		Binary: bin, GuestBinary: o.GuestBinary, SandboxBinary: o.SandboxBinary,
		Hide: []string{s.state}, Limits: o.Limits, MemMiB: o.GuestMemMiB,
	}
	if !d.Hosted {
		s.sockets = relay.NewSandboxSockets(s.gw, o.GatewayMiddleware)
		cfg.GatewayDir, cfg.Gateway = filepath.Dir(s.sock), s.sockets
		cfg.ReadOnlyBinds = map[string]string{}
		if prefix, ok := harness.OpenCodeBind(); ok {
			cfg.ReadOnlyBinds[prefix] = harness.OpenCodeSandboxDir
		}
		if o.Envs != "" && o.Provider == local.Name {
			if err := os.MkdirAll(o.Envs, 0o755); err != nil {
				return nil, fmt.Errorf("environments directory: %w", err)
			}
			cfg.ReadOnlyBinds[o.Envs] = pyenv.SandboxRoot
		}
	}
	return sandbox.Open(ctx, o.Provider, cfg)
}

// Server is the environment server. Its handler is Handler; Close releases
// what New opened and leaves the sandboxes running.
type Server struct {
	o     Options
	log   *slog.Logger
	state string
	sock  string

	store      *store.SQLite
	gw         *relay.Gateway
	sockets    *relay.SandboxSockets // the local provider's sandboxes' own gateway sockets
	provider   sandbox.Provider
	env        *episode.Env
	coord      *coordinator.Coordinator
	tasks      []*task.Task
	noOpenCode string // why an OpenCode episode is refused here ("": it is not)

	sockSrv  *http.Server
	tcpSrv   *http.Server // the gateway for hosted sandboxes
	modelSrv *http.Server
	m        *metrics

	startMu  sync.Mutex
	starting map[string]bool // episode ids being started

	reqMu    sync.Mutex
	inflight int
	closing  bool
	idle     chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// Socket names for the gateway.
const (
	socketDirPrefix = "stasis-gw-"
	socketName      = "gw.sock"
)

// GatewaySocket is the unix socket on which the server of state directory
// state serves the gateway to the relays in its sandboxes:
// /tmp/stasis-gw-HASH/gw.sock, HASH the first 16 hex digits of the SHA-256
// of the directory's absolute path. It is the same path for every server
// on that directory (relays in sandboxes that outlived a server keep
// dialing it), and short enough for a unix socket (108 bytes) whatever the
// directory. Its directory is bound into every sandbox; it is never
// deleted while a server runs, and a server's Close removes it only when
// no sandbox runs.
func GatewaySocket(state string) (string, error) {
	abs, err := filepath.Abs(state)
	if err != nil {
		return "", err
	}
	h := sha256.Sum256([]byte(abs))
	return filepath.Join("/tmp", socketDirPrefix+hex.EncodeToString(h[:])[:16], socketName), nil
}

// New opens the state directory and starts what the server runs besides
// its handler: the scripted model (without ModelUpstream), the gateway on
// its unix socket, the local provider, the record store and the
// coordinator, which re-attaches every running episode whose sandbox still
// exists and marks the others lost.
func New(ctx context.Context, o Options) (s *Server, err error) {
	if o.State == "" {
		return nil, errors.New("server: no state directory")
	}
	state, err := filepath.Abs(o.State)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(state, 0o700); err != nil {
		return nil, fmt.Errorf("server: state directory: %w", err)
	}
	if o.Tasks == nil {
		if o.Tasks, err = task.Builtin(); err != nil {
			return nil, err
		}
	}
	if o.Model == "" {
		o.Model = model.DefaultName
	}
	if o.Provider == "" {
		o.Provider = local.Name
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s = &Server{o: o, log: log, state: state, tasks: o.Tasks, starting: map[string]bool{}}
	defer func() {
		if err != nil {
			_ = s.Close()
			s = nil
		}
	}()

	// The model.
	upstream := o.ModelUpstream
	if upstream == "" {
		scripts, err := task.Scripts(o.Tasks)
		if err != nil {
			return s, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return s, fmt.Errorf("server: the scripted model: %w", err)
		}
		mh := model.New(model.Options{Scripts: scripts, Name: o.Model, Logger: log.With("component", "model")})
		s.modelSrv = &http.Server{Handler: mh, ReadHeaderTimeout: 30 * time.Second}
		go func(hs *http.Server) { _ = hs.Serve(ln) }(s.modelSrv) // not s.modelSrv: a New that fails sets s to nil
		upstream = "http://" + ln.Addr().String()
	}

	// The gateway, on its unix socket.
	if s.gw, err = relay.OpenGateway(relay.GatewayConfig{
		Upstream: upstream, State: filepath.Join(state, "gateway"), ModelKey: o.ModelKey, Logger: log.With("component", "gateway"),
	}); err != nil {
		return s, err
	}
	if s.sock, err = GatewaySocket(state); err != nil {
		return s, err
	}
	if err := os.MkdirAll(filepath.Dir(s.sock), 0o700); err != nil {
		return s, fmt.Errorf("server: the gateway's socket directory: %w", err)
	}
	sockLn, _, err := serve.Listen("unix:" + s.sock)
	if err != nil {
		return s, fmt.Errorf("server: the gateway's socket (is another server running on %s?): %w", state, err)
	}
	var gh http.Handler = s.gw.Handler()
	if o.GatewayMiddleware != nil {
		gh = o.GatewayMiddleware(gh)
	}
	s.sockSrv = &http.Server{Handler: gh, ReadHeaderTimeout: 30 * time.Second}
	go func(hs *http.Server) { _ = hs.Serve(sockLn) }(s.sockSrv) // not s.sockSrv: a New that fails sets s to nil

	// The provider.
	bin := o.Binary
	if bin == "" {
		if bin, err = sandboxbin.Path(); err != nil {
			return s, err
		}
	}
	gatewayURL := "unix://" + s.sock
	inSandbox := harness.BoundBinaryPath
	hosted := func() error {
		// Hosted sandboxes reach the gateway over the network, and get
		// the stasis binary copied in (nothing of the host is bound).
		if o.GatewayListen == "" {
			return fmt.Errorf("server: the %s provider's sandboxes reach the gateway over the network: give it a TCP address to listen on (serve --gateway-listen) and, if they see it under another name, the URL (--gateway-url)", o.Provider)
		}
		ln, shown, err := serve.Listen(o.GatewayListen)
		if err != nil {
			return fmt.Errorf("server: --gateway-listen: %w", err)
		}
		s.tcpSrv = &http.Server{Handler: gh, ReadHeaderTimeout: 30 * time.Second}
		go func(hs *http.Server) { _ = hs.Serve(ln) }(s.tcpSrv) // not s.tcpSrv: a New that fails sets s to nil
		gatewayURL = o.GatewayURL
		if gatewayURL == "" && strings.HasPrefix(shown, "unix:") {
			gatewayURL = "unix://" + strings.TrimPrefix(shown, "unix:")
		} else if gatewayURL == "" {
			gatewayURL = "http://" + shown
		}
		inSandbox = ""
		return nil
	}
	d, err := sandbox.Lookup(o.Provider)
	if err != nil {
		return s, fmt.Errorf("server: %w", err)
	}
	if d.Hosted {
		if err := hosted(); err != nil {
			return s, err
		}
	} else {
		gatewayURL = d.GatewayURL
	}
	if s.provider, err = s.openProvider(ctx, d, bin); err != nil {
		return s, err
	}
	// OpenCode episodes need it installed on this host; an OpenSandbox
	// sandbox runs the mini harness only (stasis is copied into each
	// sandbox, OpenCode is not), as `stasis run` says.
	if _, ok := harness.OpenCodeBind(); !ok {
		s.noOpenCode = "OpenCode is not installed on this server (`make deps-opencode`, or $STASIS_OPENCODE): use the mini harness"
	} else if o.Provider == opensandbox.Name {
		s.noOpenCode = "the opensandbox provider runs the mini harness only (stasis is copied into each sandbox; OpenCode is not)"
	}
	if p, ok := s.provider.(*local.Provider); ok && o.Image != "" {
		// The default image, pulled now rather than in the first
		// start's request.
		start := time.Now()
		im, err := p.Images().Resolve(ctx, o.Image, nil)
		if err != nil {
			return s, fmt.Errorf("server: the default image: %w", err)
		}
		log.Info("default image", "ref", o.Image, "digest", im.Digest, "bytes", im.Bytes, "files", im.Files, "took", time.Since(start).Round(time.Millisecond))
	}
	// Sandboxes a server before this one made: their sockets again.
	if p, ok := s.provider.(interface{ ServeGateways(context.Context) error }); ok {
		if err := p.ServeGateways(ctx); err != nil {
			return s, fmt.Errorf("server: the sandboxes' gateway sockets: %w", err)
		}
	}
	switch o.ClockPolicy {
	case "", episode.ClockContinuous, episode.ClockHost:
	default:
		return s, fmt.Errorf("server: clock policy %q: use %s or %s", o.ClockPolicy, episode.ClockContinuous, episode.ClockHost)
	}

	// Sandboxes whose keeper died (a crash of the machine or of the
	// sandboxes) are removed, so that the coordinator finds their episodes
	// lost rather than failing on them.
	if reaped, err := s.provider.GC(ctx); err != nil {
		return s, fmt.Errorf("server: reaping dead sandboxes: %w", err)
	} else if len(reaped) > 0 {
		log.Warn("sandboxes whose keeper had died removed", "sandboxes", reaped)
	}

	// The store and the coordinator.
	if s.store, err = store.OpenSQLite(filepath.Join(state, store.FileName)); err != nil {
		return s, err
	}
	s.env = &episode.Env{
		Provider: s.provider, Gateway: s.gw, GatewayURL: gatewayURL, Model: o.Model,
		Verifier: &task.Verifier{Store: s.store, Provider: s.provider, SeedDir: filepath.Join(state, "verify-seeds")},
		Binary:   bin, BinaryEnv: o.BinaryEnv, BinaryInSandbox: inSandbox, ClockPolicy: o.ClockPolicy,
		Image: o.Image,
	}
	s.m = newMetrics(s)
	clog := log.With("component", "coordinator")
	// One server per state directory (the socket above says so): the
	// coordinator finishes or undoes the prepare or restore a server that
	// died was in, and fails the checkpoints it left pending.
	if s.coord, err = coordinator.New(ctx, coordinator.Options{
		Env: s.env, Store: s.store, Tasks: o.Tasks, Concurrency: o.Concurrency, Logger: clog, Stragglers: o.Stragglers, PullImages: o.PullImages,
		LivenessInterval: livenessInterval,
		Progress: func(p coordinator.Progress) {
			clog.Debug("progress", "phase", p.Phase, "episode", p.Episode, "done", p.Done, "total", p.Total)
		},
	}); err != nil {
		return s, err
	}
	s.continueLeftPaused(ctx)
	log.Info("environment server ready", "state", state, "gateway_socket", s.sock, "model", upstream,
		"live_episodes", len(s.coord.LiveIDs()), "tasks", len(o.Tasks), "opencode", s.noOpenCode == "")
	return s, nil
}

// livenessInterval is how often the server checks that each live
// episode's sandbox is still there (an episode whose sandbox died is
// marked lost within it).
const livenessInterval = 15 * time.Second

// continueLeftPaused continues every re-attached episode that a prepare
// of an earlier server left paused (the server died between the pause and
// the continue): no prepare of this server is running yet, so a pause in
// force is nobody's.
func (s *Server) continueLeftPaused(ctx context.Context) {
	ids := s.coord.LiveIDs()
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, id := range ids {
		e, ok := s.coord.Live(id)
		if !ok {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			st, err := e.Status(ctx)
			if err != nil {
				s.log.Warn("re-attached episode: no status", "episode", id, "err", err)
				return
			}
			if st.State != supervisor.StatePaused {
				return
			}
			if _, err := e.Session().Continue(ctx, st.Seq); err != nil {
				s.log.Warn("re-attached episode left paused: continue failed", "episode", id, "seq", st.Seq, "err", err)
				return
			}
			s.log.Info("re-attached episode left paused by an earlier server: continued", "episode", id, "seq", st.Seq)
		}()
	}
	wg.Wait()
}

// GatewaySocket is the unix socket the relays in the sandboxes dial.
func (s *Server) GatewaySocket() string { return s.sock }

// Close waits (at most 30 s) for requests under way, stops the gateway's
// socket and the scripted model, and closes the gateway and the store. The
// sandboxes keep running: a server started on the same state directory
// takes them over. The socket's directory is removed only when no sandbox
// runs.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.reqMu.Lock()
		s.closing = true
		var idle chan struct{}
		if s.inflight > 0 {
			s.idle = make(chan struct{})
			idle = s.idle
		}
		s.reqMu.Unlock()
		if idle != nil {
			select {
			case <-idle:
			case <-time.After(30 * time.Second):
				s.log.Warn("closing with requests still under way")
			}
		}
		var errs []error
		if s.sockets != nil {
			s.sockets.Close()
		}
		if s.sockSrv != nil {
			errs = append(errs, s.sockSrv.Close()) // removes the socket file
			s.removeSocketDirIfUnused()
		}
		if s.tcpSrv != nil {
			errs = append(errs, s.tcpSrv.Close())
		}
		if s.provider != nil {
			errs = append(errs, s.provider.Close())
		}
		if s.modelSrv != nil {
			errs = append(errs, s.modelSrv.Close())
		}
		if s.coord != nil {
			s.coord.Close()
		}
		if s.gw != nil {
			errs = append(errs, s.gw.Close())
		}
		if s.store != nil {
			errs = append(errs, s.store.Close())
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// removeSocketDirIfUnused removes the gateway's socket directory when no
// sandbox of the state directory runs (none binds it); otherwise it stays
// for the sandboxes and the next server.
func (s *Server) removeSocketDirIfUnused() {
	if s.provider == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sbs, err := s.provider.List(ctx, nil)
	if err != nil {
		return
	}
	for _, sb := range sbs {
		if sb.State == sandbox.StateRunning {
			return
		}
	}
	_ = os.Remove(filepath.Dir(s.sock)) // only if empty
}

// enter counts a request in; false once Close has begun.
func (s *Server) enter() bool {
	s.reqMu.Lock()
	defer s.reqMu.Unlock()
	if s.closing {
		return false
	}
	s.inflight++
	return true
}

func (s *Server) leave() {
	s.reqMu.Lock()
	defer s.reqMu.Unlock()
	s.inflight--
	if s.inflight == 0 && s.idle != nil {
		close(s.idle)
		s.idle = nil
	}
}
