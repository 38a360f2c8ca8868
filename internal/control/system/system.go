// Package system assembles stasis's host side on one state directory: the
// model the gateway forwards to (the scripted one in-process, or an
// upstream), the gateway and the sockets its sandboxes reach it on, the
// sandbox provider (by the registry), the record store, the episode
// environment and the coordinator. It is the one place where they are
// wired together: the environment server, the benchmarks and the tests
// (stasistest.NewWorld) all build the system through Open.
//
// Everything durable lives in the state directory, unless Config.Store and
// Config.Blobs put the shared part in PostgreSQL and S3 (a node of a
// cluster, package cluster): the record store
// (store.db), the gateway's episodes and ledgers (gateway/), the
// provider's sandboxes and snapshots (local/, microvm/) and the Go build
// cache seeds of verify (verify-seeds/). A system closed, or killed, and
// opened again on the same directory finds its running episodes again
// (their sandboxes keep running meanwhile) and goes on serving them: the
// gateway's unix socket, which the relays inside the sandboxes dial, is at
// a path that depends only on the state directory.
package system

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

	"stasis/errdefs"
	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/episode"
	"stasis/internal/control/model"
	"stasis/internal/control/relay"
	"stasis/internal/control/serve"
	"stasis/internal/control/task"
	"stasis/internal/control/task/pyenv"
	"stasis/internal/insandbox/harness"
	"stasis/internal/insandbox/supervisor"
	_ "stasis/internal/providers" // every provider, for sandbox.Open
	"stasis/internal/providers/local"
	"stasis/internal/providers/opensandbox"
	"stasis/internal/sandboxbin"
	"stasis/internal/storage/dburl"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// Config configures a system.
type Config struct {
	// State is the state directory (made if missing).
	State string
	// Store is where the records, the episodes and the ledgers are: ""
	// for the embedded default (SQLite at STATE/store.db, ledger files
	// under STATE/gateway/ledgers), or a postgres:// URL, a database that
	// the servers of several machines share.
	Store string
	// Node names this server among several sharing Store (which must then
	// be PostgreSQL): it joins the cluster with a lease (NodeLease,
	// default cluster.DefaultLease) renewed as its heartbeat, drives only
	// its own episodes, and takes its share of every checkpoint any node
	// begins. NodeAddr is its API as the other nodes reach it.
	Node      string
	NodeAddr  string
	NodeLease time.Duration
	// Blobs is an S3 URL (s3://BUCKET/PREFIX) where a local or microVM
	// provider keeps its snapshots, so that the nodes of a cluster fork
	// each other's (sandbox.Config.Blobs); empty: in the state directory.
	Blobs string
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
	// Exe and ExeEnv: the stasis binary that runs the host provider's
	// keepers, and extra environment for it (default: this executable).
	Exe    string
	ExeEnv []string
	// Binary and BinaryEnv: the stasis binary placed in sandboxes, and the
	// environment it needs there (default: the in-sandbox binary,
	// sandboxbin.Path). Tests run their own binary as stasis.
	Binary    string
	BinaryEnv map[string]string
	// Provider names the sandbox provider, by the registry: local (the
	// default), microvm, or a hosted one, opensandbox or e2b (configured
	// by their environment variables).
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
	// GatewayMiddleware, when set, wraps the gateway's handler wherever
	// the sandboxes reach it (tests hold calls there: relay.Holds).
	GatewayMiddleware func(http.Handler) http.Handler
	// Limits are the host provider's sandboxes' limits where an episode
	// names none (zero fields: the provider's defaults).
	Limits sandbox.Limits
	// Stragglers is what a checkpoint does with an episode that cannot be
	// checkpointed (coordinator.StragglersExclude, the default, or
	// StragglersFail).
	Stragglers string
	// Image is the sandboxes' image where neither the start request nor
	// the task names one (empty: the provider's own root). A local
	// provider pulls it at Open.
	Image string
	// PullImages: a restore pulls a missing image again from the
	// reference its record names (coordinator.Options.PullImages).
	PullImages bool
	// SandboxBinary is the static in-sandbox binary a local sandbox on an
	// image execs through (local.Options.SandboxBinary; default: the
	// lean stasis-sandbox, sandboxbin.Path()).
	SandboxBinary string
	// SeedDir is where verify keeps the Go build cache seeds of its trusted
	// runs (default: STATE/verify-seeds).
	SeedDir string
	// LivenessInterval is how often the coordinator checks that each live
	// episode's sandbox is still there (0: DefaultLivenessInterval; below
	// 0: never).
	LivenessInterval time.Duration
	Logger           *slog.Logger

	// WrapProvider, when set, wraps the provider the registry opened,
	// before anything uses it (tests inject faults or watch snapshots
	// there).
	WrapProvider func(sandbox.Provider) sandbox.Provider
	// SnapshotHook, when set, is the host provider's
	// sandbox.Config.SnapshotHook (the kill matrix's step gate).
	SnapshotHook func(sandbox string) error
	// CoordinatorOptions, when set, adjusts the coordinator's options
	// before it is made (tests give it a clock or a step hook).
	CoordinatorOptions func(*coordinator.Options)
}

// DefaultLivenessInterval is how often a system checks, by default, that
// each live episode's sandbox is still there: an episode whose sandbox
// died is marked lost within it.
const DefaultLivenessInterval = 15 * time.Second

// System is the host side, assembled. Close releases what Open opened and
// leaves the sandboxes running.
type System struct {
	// State is the state directory, absolute.
	State string
	// Tasks are the tasks episodes may name.
	Tasks []*task.Task
	// ModelURL is the model the gateway forwards to.
	ModelURL string
	// Gateway is the gateway; GatewaySocket the unix socket the relays of
	// a host provider's sandboxes dial.
	Gateway       *relay.Gateway
	GatewaySocket string
	Provider      sandbox.Provider
	Store         store.Store
	// Ledgers is where the gateway keeps the episodes' ledgers.
	Ledgers ledger.Storage
	Env     *episode.Env
	// Member is this server's membership of a cluster (Config.Node), or
	// nil.
	Member      *cluster.Member
	Coordinator *coordinator.Coordinator
	// NoOpenCode says why an OpenCode episode cannot run here ("": it
	// can).
	NoOpenCode string

	log      *slog.Logger
	sockets  *relay.SandboxSockets // a host provider's sandboxes' own gateway sockets
	sockSrv  *http.Server
	tcpSrv   *http.Server // the gateway for hosted sandboxes
	modelSrv *http.Server

	closeLedgers func()
	registry     relay.Registry // nil: the gateway's files

	closeOnce sync.Once
	closeErr  error
}

// Socket names for the gateway.
const (
	socketDirPrefix = "stasis-gw-"
	socketName      = "gw.sock"
)

// GatewaySocket is the unix socket on which the system of state directory
// state serves the gateway to the relays in its sandboxes:
// /tmp/stasis-gw-HASH/gw.sock, HASH the first 16 hex digits of the SHA-256
// of the directory's absolute path. It is the same path for every system
// on that directory (relays in sandboxes that outlived one keep dialing
// it), and short enough for a unix socket (108 bytes) whatever the
// directory. Its directory is bound into every sandbox; it is never
// deleted while a system runs, and Close removes it only when no sandbox
// runs.
func GatewaySocket(state string) (string, error) {
	abs, err := filepath.Abs(state)
	if err != nil {
		return "", err
	}
	h := sha256.Sum256([]byte(abs))
	return filepath.Join("/tmp", socketDirPrefix+hex.EncodeToString(h[:])[:16], socketName), nil
}

// Open opens the state directory and assembles the system on it: the
// scripted model (without ModelUpstream), the gateway on its unix socket
// (and on GatewayListen for a hosted provider), the provider, the record
// store and the coordinator, which finishes or undoes what a system that
// died on the directory was doing and re-attaches every running episode
// whose sandbox still exists (marking the others lost). An episode that
// system left paused is continued.
func Open(ctx context.Context, c Config) (s *System, err error) {
	d, err := c.resolve()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(c.State, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	s = &System{State: c.State, Tasks: c.Tasks, log: c.Logger}
	defer func() {
		if err != nil {
			_ = s.Close()
			s = nil
		}
	}()
	if err := s.openStore(ctx, c); err != nil {
		return s, err
	}
	if err := s.openModel(c); err != nil {
		return s, err
	}
	gh, err := s.openGateway(c)
	if err != nil {
		return s, err
	}
	gatewayURL, inSandbox := d.GatewayURL, harness.BoundBinaryPath
	if d.Hosted {
		// Hosted sandboxes reach the gateway over the network, and get
		// the stasis binary copied in (nothing of the host is bound).
		if gatewayURL, err = s.listenHosted(c, gh); err != nil {
			return s, err
		}
		inSandbox = ""
	}
	if err := s.openProvider(ctx, c, d); err != nil {
		return s, err
	}
	s.Env = &episode.Env{
		Provider: s.Provider, Gateway: s.Gateway, GatewayURL: gatewayURL, Model: c.Model,
		Verifier: &task.Verifier{Store: s.Store, Provider: s.Provider, SeedDir: c.SeedDir},
		Binary:   c.Binary, BinaryEnv: c.BinaryEnv, BinaryInSandbox: inSandbox, ClockPolicy: c.ClockPolicy,
		Image: c.Image,
	}
	if err := s.openCoordinator(ctx, c); err != nil {
		return s, err
	}
	s.continueLeftPaused(ctx)
	return s, nil
}

// resolve checks c and fills in its defaults (the state directory made
// absolute); it returns the provider's driver.
func (c *Config) resolve() (d sandbox.Driver, err error) {
	if c.State == "" {
		return d, errdefs.Errorf(errdefs.ErrInvalid, "system: no state directory")
	}
	if c.State, err = filepath.Abs(c.State); err != nil {
		return d, err
	}
	if c.Node != "" && !dburl.IsPostgres(c.Store) {
		return d, errdefs.Errorf(errdefs.ErrInvalid, "node %q: the nodes of a cluster share a PostgreSQL store: give --store postgres://… (or STASIS_STORE)", c.Node)
	}
	if c.Node != "" {
		if err := store.CheckNodeName(c.Node); err != nil {
			return d, err
		}
	}
	if c.Store != "" && !dburl.IsPostgres(c.Store) {
		return d, errdefs.Errorf(errdefs.ErrInvalid, "store %q: give a postgres:// URL (a PostgreSQL database several servers share), or nothing for the embedded store in the state directory", dburl.Redact(c.Store))
	}
	if c.Tasks == nil {
		if c.Tasks, err = task.Builtin(); err != nil {
			return d, err
		}
	}
	if c.Model == "" {
		c.Model = model.DefaultName
	}
	if c.Provider == "" {
		c.Provider = local.Name
	}
	if c.SeedDir == "" {
		c.SeedDir = filepath.Join(c.State, "verify-seeds")
	}
	if c.LivenessInterval == 0 {
		c.LivenessInterval = DefaultLivenessInterval
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	switch c.ClockPolicy {
	case "", episode.ClockContinuous, episode.ClockHost:
	default:
		return d, errdefs.Errorf(errdefs.ErrInvalid, "clock policy %q: use %s or %s", c.ClockPolicy, episode.ClockContinuous, episode.ClockHost)
	}
	if d, err = sandbox.Lookup(c.Provider); err != nil {
		return d, err
	}
	if c.Blobs != "" && !d.Blobs {
		var with []string
		for _, n := range sandbox.Names() {
			if o, err := sandbox.Lookup(n); err == nil && o.Blobs {
				with = append(with, n)
			}
		}
		return d, errdefs.Errorf(errdefs.ErrInvalid, "--blobs: the %s provider keeps its snapshots itself, not in S3; the providers that keep them in S3 are %s", c.Provider, strings.Join(with, ", "))
	}
	if d.Hosted && c.GatewayListen == "" {
		return d, errdefs.Errorf(errdefs.ErrInvalid, "the %s provider's sandboxes reach the gateway over the network: give it a TCP address to listen on (serve --gateway-listen) and, if they see it under another name, the URL (--gateway-url)", c.Provider)
	}
	if c.Binary == "" {
		if c.Binary, err = sandboxbin.Path(); err != nil {
			return d, err
		}
	}
	return d, nil
}

// openCoordinator makes the coordinator. One system per state directory
// (the gateway's socket says so): the coordinator finishes or undoes the
// prepare or restore a system that died was in, and fails the checkpoints
// it left pending.
func (s *System) openCoordinator(ctx context.Context, c Config) (err error) {
	clog := s.log.With("component", "coordinator")
	co := coordinator.Options{
		Env: s.Env, Store: s.Store, Tasks: c.Tasks, Concurrency: c.Concurrency, Logger: clog, Stragglers: c.Stragglers, PullImages: c.PullImages,
		LivenessInterval: max(c.LivenessInterval, 0),
		Progress: func(p coordinator.Progress) {
			clog.Debug("progress", "phase", p.Phase, "episode", p.Episode, "done", p.Done, "total", p.Total)
		},
	}
	if s.Member != nil {
		co.Node, co.NodeLive, co.Decisions = c.Node, s.Member.NodeLive, s.Member
	}
	if c.CoordinatorOptions != nil {
		c.CoordinatorOptions(&co)
	}
	if s.Coordinator, err = coordinator.New(ctx, co); err != nil {
		return err
	}
	if s.Member != nil {
		s.Member.Serve(s.Coordinator)
	}
	return nil
}

// ProviderHome is where a system on state directory state keeps the
// named provider's sandboxes and snapshots: what `stasis sandbox --state`
// opens.
func ProviderHome(state, provider string) string { return filepath.Join(state, provider) }

// LedgerDir is where a system on state directory state without a shared
// store keeps its gateway's ledger files: what `stasis ledger --state`
// reads.
func LedgerDir(state string) string { return filepath.Join(state, "gateway", "ledgers") }

// openStore opens the record store and the ledgers' storage: c.Store's
// PostgreSQL database for both, or SQLite and files in the state
// directory.
func (s *System) openStore(ctx context.Context, c Config) (err error) {
	if c.Store == "" {
		s.Ledgers = ledger.Files(LedgerDir(s.State))
		s.Store, err = store.OpenSQLite(filepath.Join(c.State, store.FileName))
		return err
	}
	if s.Store, err = store.OpenAt(ctx, c.Store); err != nil {
		return err
	}
	pg, err := ledger.OpenPostgres(ctx, c.Store)
	if err != nil {
		return err
	}
	s.Ledgers, s.closeLedgers = pg, pg.Close
	if s.registry, err = relay.OpenRegistryPostgres(ctx, s.Store.(*store.Postgres).DB()); err != nil {
		return err
	}
	if c.Node == "" {
		return nil
	}
	if s.Member, err = cluster.Join(ctx, cluster.Options{
		Store: s.Store.(*store.Postgres), DSN: c.Store, Name: c.Node, Addr: c.NodeAddr, Lease: c.NodeLease,
		Logger: s.log.With("component", "cluster"),
	}); err != nil {
		return err
	}
	n := s.Member.Node()
	s.Store, s.Ledgers = s.Member.Store(), pg.AsNode(n.Name, n.Epoch)
	return nil
}

// openModel starts the scripted model on a loopback port, unless the
// gateway forwards to an upstream.
func (s *System) openModel(c Config) error {
	if c.ModelUpstream != "" {
		s.ModelURL = c.ModelUpstream
		return nil
	}
	scripts, err := task.Scripts(c.Tasks)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("the scripted model: %w", err)
	}
	mh := model.New(model.Options{Scripts: scripts, Name: c.Model, Logger: s.log.With("component", "model")})
	s.modelSrv = &http.Server{Handler: mh, ReadHeaderTimeout: 30 * time.Second}
	go func(hs *http.Server) { _ = hs.Serve(ln) }(s.modelSrv)
	s.ModelURL = "http://" + ln.Addr().String()
	return nil
}

// openGateway opens the gateway and serves it on its unix socket; it
// returns the handler the sandboxes reach (with c.GatewayMiddleware).
func (s *System) openGateway(c Config) (http.Handler, error) {
	var err error
	if s.Gateway, err = relay.OpenGateway(relay.GatewayConfig{
		Upstream: s.ModelURL, State: filepath.Join(s.State, "gateway"), ModelKey: c.ModelKey, Logger: s.log.With("component", "gateway"),
		Ledgers: s.Ledgers, Registry: s.registry,
	}); err != nil {
		return nil, err
	}
	if s.GatewaySocket, err = GatewaySocket(s.State); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(s.GatewaySocket), 0o700); err != nil {
		return nil, fmt.Errorf("the gateway's socket directory: %w", err)
	}
	ln, _, err := serve.Listen("unix:" + s.GatewaySocket)
	if err != nil {
		return nil, errdefs.Errorf(errdefs.ErrConflict, "the gateway's socket (is another server running on %s?): %v", s.State, err)
	}
	var gh http.Handler = s.Gateway.Handler()
	if c.GatewayMiddleware != nil {
		gh = c.GatewayMiddleware(gh)
	}
	s.sockSrv = &http.Server{Handler: gh, ReadHeaderTimeout: 30 * time.Second}
	go func(hs *http.Server) { _ = hs.Serve(ln) }(s.sockSrv)
	return gh, nil
}

// listenHosted serves the gateway on c.GatewayListen for hosted
// sandboxes; it returns the URL their relays reach it at.
func (s *System) listenHosted(c Config, gh http.Handler) (string, error) {
	ln, shown, err := serve.Listen(c.GatewayListen)
	if err != nil {
		return "", fmt.Errorf("--gateway-listen: %w", err)
	}
	s.tcpSrv = &http.Server{Handler: gh, ReadHeaderTimeout: 30 * time.Second}
	go func(hs *http.Server) { _ = hs.Serve(ln) }(s.tcpSrv)
	switch {
	case c.GatewayURL != "":
		return c.GatewayURL, nil
	case strings.HasPrefix(shown, "unix:"):
		return "unix://" + strings.TrimPrefix(shown, "unix:"), nil
	default:
		return "http://" + shown, nil
	}
}

// openProvider opens the provider (c.Provider, by the registry) on its
// part of the state directory. A host provider's sandboxes each get a
// gateway socket of their own, on which only their episode's token is
// valid; they see nothing of the state directory (every episode's token
// and the record store are there), and they get the stasis binary and,
// when installed, OpenCode read-only (a local sandbox by bind mounts, a
// microVM guest in its image and on an erofs disk). The SWE-bench
// environments are bound into local sandboxes, where their venvs expect
// them. A local provider pulls the default image now rather than in the
// first start's request; the sandboxes an earlier system made get their
// sockets again, and those whose keeper died are removed, so that the
// coordinator finds their episodes lost rather than failing on them.
func (s *System) openProvider(ctx context.Context, c Config, d sandbox.Driver) error {
	cfg := sandbox.Config{
		Home: ProviderHome(s.State, c.Provider), Exe: c.Exe, ExeEnv: c.ExeEnv,
		Binary: c.Binary, GuestBinary: c.GuestBinary, SandboxBinary: c.SandboxBinary,
		Hide: []string{s.State}, Limits: c.Limits, MemMiB: c.GuestMemMiB, Blobs: c.Blobs,
		SnapshotHook: c.SnapshotHook,
	}
	if !d.Hosted {
		s.sockets = relay.NewSandboxSockets(s.Gateway, c.GatewayMiddleware)
		cfg.GatewayDir, cfg.Gateway = filepath.Dir(s.GatewaySocket), s.sockets
		cfg.ReadOnlyBinds = map[string]string{}
		if prefix, ok := harness.OpenCodeBind(); ok {
			cfg.ReadOnlyBinds[prefix] = harness.OpenCodeSandboxDir
		}
		if c.Envs != "" && c.Provider == local.Name {
			if err := os.MkdirAll(c.Envs, 0o755); err != nil {
				return fmt.Errorf("environments directory: %w", err)
			}
			cfg.ReadOnlyBinds[c.Envs] = pyenv.SandboxRoot
		}
	}
	var err error
	if s.Provider, err = sandbox.Open(ctx, c.Provider, cfg); err != nil {
		return err
	}

	// OpenCode episodes need it installed on this host; an OpenSandbox
	// sandbox runs the mini harness only (stasis is copied into each
	// sandbox, OpenCode is not).
	if _, ok := harness.OpenCodeBind(); !ok {
		s.NoOpenCode = "OpenCode is not installed on this server (`make deps-opencode`, or $STASIS_OPENCODE): use the mini harness"
	} else if c.Provider == opensandbox.Name {
		s.NoOpenCode = "the opensandbox provider runs the mini harness only (stasis is copied into each sandbox; OpenCode is not)"
	}
	if p, ok := s.Provider.(*local.Provider); ok && c.Image != "" {
		start := time.Now()
		im, err := p.Images().Resolve(ctx, c.Image, nil)
		if err != nil {
			return fmt.Errorf("the default image: %w", err)
		}
		s.log.Info("default image", "ref", c.Image, "digest", im.Digest, "bytes", im.Bytes, "files", im.Files, "took", time.Since(start).Round(time.Millisecond))
	}
	if p, ok := s.Provider.(interface{ ServeGateways(context.Context) error }); ok {
		if err := p.ServeGateways(ctx); err != nil {
			return fmt.Errorf("the sandboxes' gateway sockets: %w", err)
		}
	}
	reaped, err := s.Provider.GC(ctx)
	if err != nil {
		return fmt.Errorf("reaping dead sandboxes: %w", err)
	}
	if len(reaped) > 0 {
		s.log.Warn("sandboxes whose keeper had died removed", "sandboxes", reaped)
	}
	if c.WrapProvider != nil {
		s.Provider = c.WrapProvider(s.Provider)
	}
	return nil
}

// continueLeftPaused continues every re-attached episode that a prepare
// of an earlier system left paused (it died between the pause and the
// continue): no prepare of this system is running yet, so a pause in
// force is nobody's.
func (s *System) continueLeftPaused(ctx context.Context) {
	ids := s.Coordinator.LiveIDs()
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, id := range ids {
		e, ok := s.Coordinator.Live(id)
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
			s.log.Info("re-attached episode left paused by an earlier system: continued", "episode", id, "seq", st.Seq)
		}()
	}
	wg.Wait()
}

// Close stops the gateway's sockets and the scripted model, and closes the
// provider, the coordinator, the gateway and the store. The sandboxes keep
// running: a system opened on the same state directory takes them over.
// The socket's directory is removed only when no sandbox runs.
func (s *System) Close() error {
	s.closeOnce.Do(func() {
		var errs []error
		if s.Member != nil {
			// First: a share under way uses the coordinator, the
			// provider and the gateway.
			errs = append(errs, s.Member.Close())
		}
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
		if s.Provider != nil {
			errs = append(errs, s.Provider.Close())
		}
		if s.modelSrv != nil {
			errs = append(errs, s.modelSrv.Close())
		}
		if s.Coordinator != nil {
			s.Coordinator.Close()
		}
		if s.Gateway != nil {
			errs = append(errs, s.Gateway.Close())
		}
		if s.Store != nil {
			errs = append(errs, s.Store.Close())
		}
		if s.closeLedgers != nil {
			s.closeLedgers()
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// removeSocketDirIfUnused removes the gateway's socket directory when no
// sandbox of the state directory runs (none binds it); otherwise it stays
// for the sandboxes and the next system.
func (s *System) removeSocketDirIfUnused() {
	if s.Provider == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sbs, err := s.Provider.List(ctx, nil)
	if err != nil {
		return
	}
	for _, sb := range sbs {
		if sb.State == sandbox.StateRunning {
			return
		}
	}
	_ = os.Remove(filepath.Dir(s.GatewaySocket)) // only if empty
}
