// Package server is the environment server (`stasis serve`): an HTTP JSON
// API over a checkpoint coordinator, for trainers. It starts episodes,
// lists, gets, verifies and retires them, takes checkpoints (prepare and
// commit in one call), lists, gets, restores and deletes them, and serves
// Prometheus metrics, liveness and its OpenAPI document
// (internal/control/openapi/server.json). Who may call it is its Access (auth.go): loopback
// or a unix socket without credentials, the network only with bearer
// tokens or client certificates; the gateway is served only where the
// sandboxes reach it, never on the API.
//
// The system it serves is assembled by package system on one state
// directory; a server killed and started again on the same directory finds
// its running episodes again and goes on serving them.
package server

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/episode"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	_ "stasis/internal/providers" // every provider, for sandbox.Open
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// Options configure a Server: the system it serves (system.Config), and
// who may call its API.
type Options struct {
	system.Config
	// Access guards the API's handler (NewAccess for its listener);
	// default LoopbackAccess.
	Access *Access
}

// Server is the environment server. Its handler is Handler; Close releases
// what New opened and leaves the sandboxes running.
type Server struct {
	o   Options
	log *slog.Logger
	sys *system.System

	// The system's parts, as the handlers use them.
	store  store.Store
	member *cluster.Member // nil unless the server is a node of a cluster
	// forwarder carries requests about another node's episode there.
	forwarder  http.RoundTripper
	gw         *relay.Gateway
	provider   sandbox.Provider
	env        *episode.Env
	coord      *coordinator.Coordinator
	tasks      []*task.Task
	noOpenCode string // why an OpenCode episode is refused here ("": it is not)

	m *metrics

	startMu  sync.Mutex
	starting map[string]bool // episode ids being started

	reqMu    sync.Mutex
	inflight int
	closing  bool
	idle     chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// GatewaySocket is the unix socket on which the server of state directory
// state serves the gateway to the relays in its sandboxes
// (system.GatewaySocket).
func GatewaySocket(state string) (string, error) { return system.GatewaySocket(state) }

// New assembles the system on the state directory (system.Open: the
// scripted model without ModelUpstream, the gateway on its unix socket,
// the provider, the record store and the coordinator, which re-attaches
// every running episode whose sandbox still exists and marks the others
// lost) and the server's metrics over it.
func New(ctx context.Context, o Options) (*Server, error) {
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
		o.Logger = log
	}
	sys, err := system.Open(ctx, o.Config)
	if err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	s := &Server{
		o: o, log: log, sys: sys, starting: map[string]bool{},
		member: sys.Member, forwarder: http.DefaultTransport.(*http.Transport).Clone(), store: sys.Store, gw: sys.Gateway, provider: sys.Provider, env: sys.Env, coord: sys.Coordinator, tasks: sys.Tasks, noOpenCode: sys.NoOpenCode,
	}
	s.m = newMetrics(s)
	log.Info("environment server ready", "state", sys.State, "gateway_socket", sys.GatewaySocket, "model", sys.ModelURL,
		"live_episodes", len(s.coord.LiveIDs()), "tasks", len(s.tasks), "opencode", s.noOpenCode == "")
	return s, nil
}

// GatewaySocket is the unix socket the relays in the sandboxes dial.
func (s *Server) GatewaySocket() string { return s.sys.GatewaySocket }

// Close waits (at most 30 s) for requests under way and closes the
// system (system.System.Close). The sandboxes keep running: a server
// started on the same state directory takes them over.
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
		s.closeErr = s.sys.Close()
	})
	return s.closeErr
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
