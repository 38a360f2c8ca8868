package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"stasis/atomicfile"
	"stasis/ledger"
	"stasis/openapi"
)

// EpisodeState is an episode as the gateway knows it:
// STATE/episodes/EPISODE.json.
type EpisodeState struct {
	Episode string    `json:"episode"`
	Token   string    `json:"token"`
	Attempt int       `json:"attempt"`
	Created time.Time `json:"created"`
	// NeedMatch: the episode was relaunched; its next call is matched
	// against the ledger (Ledger.Match) before it is recorded.
	NeedMatch bool `json:"need_match,omitempty"`
	// Sandbox is the sandbox the episode runs in now (Bind): on a
	// sandbox's own socket (SandboxHandler) only its episode's token is
	// valid.
	Sandbox string `json:"sandbox,omitempty"`
	// Revoked: the episode was retired (Revoke); its token is refused
	// until a restore brings the episode back.
	Revoked bool `json:"revoked,omitempty"`
}

// Credentials returns the relay's token file contents for this episode.
func (e EpisodeState) Credentials(nextCall int64) Credentials {
	return Credentials{Episode: e.Episode, Token: e.Token, Attempt: e.Attempt, NextCall: nextCall}
}

// GatewayConfig configures a Gateway.
type GatewayConfig struct {
	Upstream string // the model server
	State    string // directory: episodes/ and ledgers/
	// ModelKey is sent to the model server as a bearer token, if set.
	ModelKey string
	MaxBody  int64
	Logger   *slog.Logger
	// Clock stamps episodes and ledger entries (nil: the system's).
	Clock Clock
}

// Gateway is the host end: it authenticates episodes by bearer token,
// refuses stale attempts, answers a call id already recorded from the
// ledger, and records every new response in the episode's ledger before it
// answers.
type Gateway struct {
	up    *Upstream
	cfg   GatewayConfig
	clock Clock
	log   *slog.Logger
	reg   *prometheus.Registry
	m     gatewayMetrics

	mu       sync.Mutex
	episodes map[string]*EpisodeState
	tokens   map[string]string // token → episode
	ledgers  map[string]*ledger.Ledger
	opening  map[string]chan struct{} // episode whose ledger is being opened
	inflight map[string]chan struct{} // episode/call id being answered
	epLocks  map[string]*sync.Mutex
}

type gatewayMetrics struct {
	calls                            *prometheus.CounterVec
	ok                               prometheus.Counter // calls{code="200"}
	dedupe, stale, unauthorized, bad prometheus.Counter
	upstream, added                  prometheus.Histogram
}

var episodeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidName reports whether id may name an episode: letters, digits, '.',
// '_' and '-', starting with a letter or digit, at most 128.
func ValidName(id string) bool { return episodeName.MatchString(id) }

// OpenGateway opens the gateway over its state directory.
func OpenGateway(cfg GatewayConfig) (*Gateway, error) {
	up, err := ParseUpstream(cfg.Upstream)
	if err != nil {
		return nil, err
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	for _, d := range []string{"episodes", "ledgers"} {
		if err := os.MkdirAll(filepath.Join(cfg.State, d), 0o700); err != nil {
			return nil, fmt.Errorf("gateway state: %w", err)
		}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	g := &Gateway{up: up, cfg: cfg, clock: clockOr(cfg.Clock), log: log, reg: prometheus.NewRegistry(),
		episodes: map[string]*EpisodeState{}, tokens: map[string]string{}, ledgers: map[string]*ledger.Ledger{},
		opening: map[string]chan struct{}{}, inflight: map[string]chan struct{}{}, epLocks: map[string]*sync.Mutex{}}
	buckets := prometheus.ExponentialBuckets(0.00005, 2, 18)
	g.m = gatewayMetrics{
		calls:        prometheus.NewCounterVec(prometheus.CounterOpts{Name: "stasis_gateway_calls_total", Help: "Calls answered, by status code."}, []string{"code"}),
		dedupe:       prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_dedupe_hits_total", Help: "Calls answered from the ledger without calling the model."}),
		stale:        prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_stale_attempts_total", Help: "Calls refused for a stale attempt."}),
		unauthorized: prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_unauthorized_total", Help: "Calls refused for an unknown token."}),
		bad:          prometheus.NewCounter(prometheus.CounterOpts{Name: "stasis_gateway_bad_requests_total", Help: "Malformed or oversized calls."}),
		upstream:     prometheus.NewHistogram(prometheus.HistogramOpts{Name: "stasis_gateway_upstream_seconds", Help: "Model server round trip.", Buckets: buckets}),
		added:        prometheus.NewHistogram(prometheus.HistogramOpts{Name: "stasis_gateway_added_seconds", Help: "Time in the gateway beyond the model server's round trip (ledger write included).", Buckets: buckets}),
	}
	g.m.ok = g.m.calls.WithLabelValues("200")
	g.reg.MustRegister(g.m.calls, g.m.dedupe, g.m.stale, g.m.unauthorized, g.m.bad, g.m.upstream, g.m.added,
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "stasis_gateway_ledger_flushes_total", Help: "Disk flushes made for ledger writes (in this process); writes that wait at once share one."},
			func() float64 { f, _ := ledger.Flushes(); return float64(f) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "stasis_gateway_ledger_flushed_writes_total", Help: "Ledger writes (appends and cuts, in this process) those flushes made durable."},
			func() float64 { _, w := ledger.Flushes(); return float64(w) }))
	if err := g.reload(); err != nil {
		return nil, err
	}
	return g, nil
}

// Close closes the ledgers.
func (g *Gateway) Close() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	var errs []error
	for _, l := range g.ledgers {
		errs = append(errs, l.Close())
	}
	g.ledgers = map[string]*ledger.Ledger{}
	return errors.Join(errs...)
}

// LedgerDir is where the episodes' ledgers are.
func (g *Gateway) LedgerDir() string { return filepath.Join(g.cfg.State, "ledgers") }

func (g *Gateway) epPath(id string) string {
	return filepath.Join(g.cfg.State, "episodes", id+".json")
}

// reload reads every episode file (another process may have added one);
// it runs at start and when a token is not known.
func (g *Gateway) reload() error {
	ents, err := os.ReadDir(filepath.Join(g.cfg.State, "episodes"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok {
			_ = g.load(id)
		}
	}
	return nil
}

// load reads one episode's file into the gateway's maps; an episode without
// a file gives an error wrapping ErrUnknownEpisode.
func (g *Gateway) load(id string) error {
	if !episodeName.MatchString(id) {
		return fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	b, err := os.ReadFile(g.epPath(id))
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("episode %q: %w", id, ErrUnknownEpisode)
	}
	if err != nil {
		return err
	}
	var st EpisodeState
	if err := json.Unmarshal(b, &st); err != nil || st.Episode != id {
		return fmt.Errorf("episode %q: %s is damaged (%v)", id, g.epPath(id), err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if old, ok := g.episodes[id]; ok {
		delete(g.tokens, old.Token)
	}
	g.episodes[id] = &st
	g.tokens[st.Token] = id
	return nil
}

func (g *Gateway) saveLocked(st *EpisodeState) error {
	return atomicfile.WriteJSON(g.epPath(st.Episode), st, 0o600)
}

// AddEpisode registers an episode with a fresh bearer token, attempt 0,
// and opens its ledger (creating the file), so that its first call finds
// the ledger open rather than creating it.
func (g *Gateway) AddEpisode(id string) (EpisodeState, error) {
	if !episodeName.MatchString(id) {
		return EpisodeState{}, fmt.Errorf("episode name %q: use letters, digits, '.', '_' and '-' (at most 128)", id)
	}
	if err := g.load(id); !errors.Is(err, ErrUnknownEpisode) {
		return EpisodeState{}, fmt.Errorf("episode %q already exists", id)
	}
	if _, err := g.ledger(id); err != nil {
		return EpisodeState{}, fmt.Errorf("episode %q: %w", id, err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	st := &EpisodeState{Episode: id, Token: hex.EncodeToString(b), Created: g.clock.Now().UTC()}
	if err := g.saveLocked(st); err != nil {
		return EpisodeState{}, err
	}
	g.episodes[id] = st
	g.tokens[st.Token] = id
	return *st, nil
}

// Episode returns an episode's state.
func (g *Gateway) Episode(id string) (EpisodeState, error) {
	if err := g.load(id); err != nil {
		return EpisodeState{}, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return *g.episodes[id], nil
}

// Bind records that episode id now runs in sandbox: from now on the
// episode's token is valid on that sandbox's socket only (SandboxHandler),
// and the sandbox's socket accepts no other episode's token. An episode's
// token is never valid on a socket of another sandbox, so a token an agent
// captured is of no use from its own sandbox.
func (g *Gateway) Bind(id, sandbox string) error {
	return g.update(id, func(st *EpisodeState) { st.Sandbox = sandbox })
}

// Revoke refuses episode id's token at once, on every socket, from the
// next call on (calls already admitted finish): a retired episode makes no
// more model calls and its ledger takes no more entries. A later Restore
// of the episode (a checkpoint restored) lifts it.
func (g *Gateway) Revoke(id string) error {
	return g.update(id, func(st *EpisodeState) { st.Revoked = true })
}

// update changes and saves one episode's state under its lock.
func (g *Gateway) update(id string, change func(*EpisodeState)) error {
	if err := g.load(id); err != nil {
		return err
	}
	lock := g.epLock(id)
	lock.Lock()
	defer lock.Unlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	st := g.episodes[id]
	next := *st
	change(&next)
	if err := g.saveLocked(&next); err != nil {
		return err
	}
	*st = next
	return nil
}

// ErrUnknownEpisode is returned for an episode the gateway has not
// registered.
var ErrUnknownEpisode = errors.New("unknown episode")

// Restore starts the episode's next attempt. In place (the snapshot kept
// the harness's processes), the ledger is cut to position, the relay's
// settled position at the pause (relay_position; relay_delivered in
// acknowledgements older than it); otherwise (a relaunch) the next call is
// matched against the ledger. Calls of older attempts are refused from now
// on.
func (g *Gateway) Restore(id string, inPlace bool, position int64) (EpisodeState, error) {
	if err := g.load(id); err != nil {
		return EpisodeState{}, err
	}
	l, err := g.ledger(id)
	if err != nil {
		return EpisodeState{}, err
	}
	lock := g.epLock(id)
	lock.Lock()
	defer lock.Unlock()
	g.mu.Lock()
	st := g.episodes[id]
	g.mu.Unlock()
	if inPlace {
		if position < 0 || position > l.Len() {
			return EpisodeState{}, fmt.Errorf("episode %q: cannot cut its ledger of %d entries to %d", id, l.Len(), position)
		}
		if err := l.Cut(position, fmt.Sprintf("restore in place, attempt %d", st.Attempt+1)); err != nil {
			return EpisodeState{}, err
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	next := *st
	next.Attempt++
	next.NeedMatch = !inPlace
	next.Revoked = false
	if err := g.saveLocked(&next); err != nil {
		return EpisodeState{}, err
	}
	*st = next
	return next, nil
}

// Fork registers episode dst as a copy of src's history up to position
// upTo: dst gets its own token and a ledger holding src's first upTo
// entries (appended anew, so under dst's own hash chain), and src's
// attempt, so that a Restore of dst starts a newer one. It is how one
// checkpointed episode continues as several (a fork of N), each with its
// own ledger.
func (g *Gateway) Fork(src, dst string, upTo int64) (EpisodeState, error) {
	if err := g.load(src); err != nil {
		return EpisodeState{}, err
	}
	l, err := g.ledger(src)
	if err != nil {
		return EpisodeState{}, err
	}
	entries := l.Entries()
	if upTo < 0 || upTo > int64(len(entries)) {
		return EpisodeState{}, fmt.Errorf("episode %q: cannot fork its ledger of %d entries at %d", src, len(entries), upTo)
	}
	if _, err := g.AddEpisode(dst); err != nil {
		return EpisodeState{}, err
	}
	dl, err := g.ledger(dst)
	if err != nil {
		return EpisodeState{}, err
	}
	var settled []ledger.Settlement
	for _, e := range entries[:upTo] {
		disp := e.Disposition
		e.Seq, e.Parent, e.Hash, e.Disposition = 0, "", "", ""
		c, err := dl.Append(e)
		if err != nil {
			return EpisodeState{}, fmt.Errorf("episode %q: copy %s's entry %s: %w", dst, src, e.CallID, err)
		}
		if disp == ledger.Delivered || disp == ledger.Abandoned {
			settled = append(settled, ledger.Settlement{Seq: c.Seq, CallID: c.CallID, Disposition: disp})
		}
	}
	if len(settled) > 0 {
		if err := dl.Settle(settled...); err != nil {
			return EpisodeState{}, fmt.Errorf("episode %q: copy %s's dispositions: %w", dst, src, err)
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	next := *g.episodes[dst]
	next.Attempt = g.episodes[src].Attempt
	next.Revoked = false
	if err := g.saveLocked(&next); err != nil {
		return EpisodeState{}, err
	}
	*g.episodes[dst] = next
	return next, nil
}

func (g *Gateway) epLock(id string) *sync.Mutex {
	g.mu.Lock()
	defer g.mu.Unlock()
	l, ok := g.epLocks[id]
	if !ok {
		l = &sync.Mutex{}
		g.epLocks[id] = l
	}
	return l
}

// Remove forgets an episode: its registration, its token and its ledger
// file. It is for undoing a copy that Fork made and a failed restore never
// installed; an episode a store still names must not be removed.
func (g *Gateway) Remove(id string) error {
	if err := g.load(id); err != nil {
		return err
	}
	mu := g.epLock(id)
	mu.Lock()
	defer mu.Unlock()
	g.mu.Lock()
	l := g.ledgers[id]
	delete(g.ledgers, id)
	if st, ok := g.episodes[id]; ok {
		delete(g.tokens, st.Token)
	}
	delete(g.episodes, id)
	g.mu.Unlock()
	var errs []error
	if l != nil {
		errs = append(errs, l.Close())
	}
	lp, err := ledger.Path(g.LedgerDir(), id)
	if err == nil {
		if err := os.Remove(lp); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(g.epPath(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// ledger returns the episode's open ledger, opening it on its first call.
// The open (a file created, its directory fsync'd, an old file read and
// checked) happens outside g.mu, so one episode's first call does not stall
// every other episode's calls; a second caller for the same episode waits
// for the first one's open.
func (g *Gateway) ledger(id string) (*ledger.Ledger, error) {
	for {
		g.mu.Lock()
		if l, ok := g.ledgers[id]; ok {
			g.mu.Unlock()
			return l, nil
		}
		if ch, ok := g.opening[id]; ok {
			g.mu.Unlock()
			<-ch
			continue
		}
		ch := make(chan struct{})
		g.opening[id] = ch
		g.mu.Unlock()
		l, err := ledger.Open(g.LedgerDir(), id)
		g.mu.Lock()
		delete(g.opening, id)
		close(ch)
		if err == nil {
			g.ledgers[id] = l
		}
		g.mu.Unlock()
		return l, err
	}
}

// Handler serves the relays: the OpenAI-compatible endpoints, /metrics and
// /healthz.
func (g *Gateway) Handler() http.Handler { return mux(g.routes()) }

// Metrics gathers the gateway's Prometheus metrics (those its /metrics
// serves), for a server that shows them elsewhere.
func (g *Gateway) Metrics() prometheus.Gatherer { return g.reg }

// SandboxHandler is Handler for one sandbox's own socket: only the token
// of the episode bound to that sandbox (Bind) is valid on it.
func (g *Gateway) SandboxHandler(sandbox string) http.Handler {
	h := g.Handler()
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		h.ServeHTTP(w, q.WithContext(context.WithValue(q.Context(), socketKey{}, sandbox)))
	})
}

// socketKey is the context key of the sandbox whose socket a request came
// in on (SandboxHandler).
type socketKey struct{}

// Routes lists the operations the handler serves ("METHOD /path").
func (g *Gateway) Routes() []string { return keys(g.routes()) }

func (g *Gateway) routes() map[string]http.Handler {
	r := apiRoutes(g.serveCall, g.serveModels, g.reg, openapi.Gateway)
	r["POST "+settlePath] = http.HandlerFunc(g.serveSettle)
	return r
}

// authenticate finds the episode of the bearer token: one not revoked,
// and, on a sandbox's own socket, bound to that sandbox.
func (g *Gateway) authenticate(q *http.Request) (EpisodeState, bool) {
	st, ok := g.lookup(q)
	if !ok || st.Revoked {
		return EpisodeState{}, false
	}
	if sb, bound := q.Context().Value(socketKey{}).(string); bound && st.Sandbox != sb {
		return EpisodeState{}, false
	}
	return st, true
}

// lookup finds the episode of the bearer token.
func (g *Gateway) lookup(q *http.Request) (EpisodeState, bool) {
	tok, ok := strings.CutPrefix(q.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return EpisodeState{}, false
	}
	for pass := 0; pass < 2; pass++ {
		g.mu.Lock()
		id, found := g.tokens[tok]
		var st EpisodeState
		if found {
			st = *g.episodes[id]
		}
		g.mu.Unlock()
		if found {
			return st, true
		}
		if pass == 0 {
			_ = g.reload() // registered by another process since
		}
	}
	return EpisodeState{}, false
}

func (g *Gateway) reply(w http.ResponseWriter, status int, typ, msg string) {
	g.m.calls.WithLabelValues(strconv.Itoa(status)).Inc()
	apiError(w, status, typ, msg)
}

// requestHash fingerprints a request body in the compact form the ledger
// stores it in.
func requestHash(b []byte) string {
	if c, err := json.Marshal(json.RawMessage(b)); err == nil {
		b = c
	}
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// admit authenticates a relay's request and checks its attempt is the
// episode's current one; when it is not, the refusal is written and ok is
// false.
func (g *Gateway) admit(w http.ResponseWriter, q *http.Request) (st EpisodeState, attempt int, ok bool) {
	st, ok = g.authenticate(q)
	if !ok {
		g.m.unauthorized.Inc()
		g.reply(w, http.StatusUnauthorized, "authentication_error", "unknown or missing episode token")
		return st, 0, false
	}
	attempt, err := strconv.Atoi(q.Header.Get(HeaderAttempt))
	if err != nil {
		g.m.bad.Inc()
		g.reply(w, http.StatusBadRequest, "invalid_request_error", "missing or bad "+HeaderAttempt+" header")
		return st, 0, false
	}
	if attempt != st.Attempt {
		g.m.stale.Inc()
		g.reply(w, http.StatusConflict, "stale_attempt", fmt.Sprintf("stale attempt %d: episode %s is at attempt %d", attempt, st.Episode, st.Attempt))
		return st, 0, false
	}
	return st, attempt, true
}

func (g *Gateway) serveCall(w http.ResponseWriter, q *http.Request, path string) {
	start := g.clock.Now()
	st, attempt, ok := g.admit(w, q)
	if !ok {
		return
	}
	callID := q.Header.Get(HeaderCallID)
	if n, ok := strings.CutPrefix(callID, st.Episode+"/"); !ok || n == "" {
		g.m.bad.Inc()
		g.reply(w, http.StatusBadRequest, "invalid_request_error", fmt.Sprintf("%s %q must be %s/N", HeaderCallID, callID, st.Episode))
		return
	}
	body, err := readAll(http.MaxBytesReader(w, q.Body, g.cfg.MaxBody), q.ContentLength)
	if err != nil {
		g.m.bad.Inc()
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			g.reply(w, http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", g.cfg.MaxBody))
			return
		}
		g.reply(w, http.StatusBadRequest, "invalid_request_error", "read request: "+err.Error())
		return
	}
	// A cheap check: the model server judges the rest (and answers 400),
	// and the ledger validates whatever it records.
	if t := bytes.TrimLeft(body, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		g.m.bad.Inc()
		g.reply(w, http.StatusBadRequest, "invalid_request_error", "request body must be a JSON object")
		return
	}
	l, err := g.ledger(st.Episode)
	if err != nil {
		g.reply(w, http.StatusInternalServerError, "server_error", err.Error())
		return
	}
	// One answer per call id at a time: a duplicate arriving while the first
	// is being answered waits for it, then is answered from the ledger.
	key := st.Episode + "\x00" + callID
	for {
		g.mu.Lock()
		ch, busy := g.inflight[key]
		if !busy {
			g.inflight[key] = make(chan struct{})
		}
		g.mu.Unlock()
		if !busy {
			break
		}
		select {
		case <-ch:
		case <-q.Context().Done():
			return
		}
	}
	defer func() {
		g.mu.Lock()
		close(g.inflight[key])
		delete(g.inflight, key)
		g.mu.Unlock()
	}()
	// A relaunched harness re-sends its conversation: match it against the
	// ledger first (which cuts what it never acted on), then dedupe.
	if st.NeedMatch && path == "/v1/chat/completions" {
		var reqObj struct {
			Messages []json.RawMessage `json:"messages"`
		}
		_ = json.Unmarshal(body, &reqObj)
		lock := g.epLock(st.Episode)
		lock.Lock()
		_, merr := l.Match(reqObj.Messages)
		g.mu.Lock()
		if cur := g.episodes[st.Episode]; cur != nil && cur.Attempt == st.Attempt {
			cur.NeedMatch = false
			_ = g.saveLocked(cur)
		}
		g.mu.Unlock()
		lock.Unlock()
		if merr != nil {
			g.log.Warn("relaunch does not match the ledger: history marked broken", "episode", st.Episode, "err", merr)
		}
	}
	// Settlements of earlier calls ride on this one: they are recorded with
	// its entry (one write, one flush), or alone when no entry is appended.
	settled, err := g.settlements(st.Episode, l, q.Header.Get(HeaderSettled))
	if err != nil {
		g.log.Warn("bad settlements from a relay", "episode", st.Episode, "err", err)
	}
	settledAlone := func() {
		if err := settleAlone(w, l, settled); err != nil {
			g.log.Warn("settlements not recorded", "episode", st.Episode, "err", err)
		}
	}
	if e, ok := l.Lookup(callID); ok {
		settledAlone()
		if requestHash(e.Request) != requestHash(body) {
			g.reply(w, http.StatusConflict, "call_id_reused", fmt.Sprintf("call id %s is already recorded with another request", callID))
			return
		}
		g.m.dedupe.Inc()
		g.answer(w, l, e, q)
		return
	}
	t0 := g.clock.Now()
	status, header, respBody, buf, err := g.forward(q.Context(), path, body)
	// The ledger keeps its own copy of the answer, so the buffer it was
	// read into goes back to the pool when this call is answered.
	defer releaseBody(buf)
	upTime := g.clock.Now().Sub(t0)
	g.m.upstream.Observe(upTime.Seconds())
	if err != nil {
		settledAlone()
		g.reply(w, http.StatusBadGateway, "upstream_error", err.Error())
		return
	}
	if status/100 != 2 {
		settledAlone()
		g.m.calls.WithLabelValues(strconv.Itoa(status)).Inc()
		for _, h := range []string{"Content-Type", "Retry-After"} {
			if v := header.Get(h); v != "" {
				w.Header().Set(h, v)
			}
		}
		w.WriteHeader(status)
		_, _ = w.Write(respBody)
		return
	}
	if strings.HasPrefix(header.Get("Content-Type"), "text/event-stream") {
		evs, err := ParseSSE(bytes.NewReader(respBody))
		if err == nil {
			respBody, err = AssembleChat(evs)
		}
		if err != nil {
			settledAlone()
			g.reply(w, http.StatusBadGateway, "upstream_error", "model stream: "+err.Error())
			return
		}
	}
	e, serr, err := l.SettleAndAppend(settled, ledger.Entry{
		// Usage and tokens are read from the response by the ledger.
		CallID: callID, Attempt: attempt, Request: body, Response: respBody, Started: t0, Finished: g.clock.Now(),
	})
	if serr != nil {
		g.log.Warn("settlements not recorded", "episode", st.Episode, "err", serr)
	}
	if err != nil {
		g.log.Error("ledger append failed", "episode", st.Episode, "call", callID, "err", err)
		g.reply(w, http.StatusInternalServerError, "server_error", "ledger: "+err.Error())
		return
	}
	w.Header().Set(HeaderSettledOK, "1")
	g.answer(w, l, e, q)
	g.m.added.Observe((g.clock.Now().Sub(start) - upTime).Seconds())
}

func (g *Gateway) answer(w http.ResponseWriter, l *ledger.Ledger, e ledger.Entry, q *http.Request) {
	g.m.ok.Inc()
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(e.Response)))
	h.Set(HeaderLedgerSeq, strconv.FormatInt(e.Seq, 10))
	if q.Header.Get(HeaderWantBase) != "" {
		h.Set(HeaderDeliveredBefore, strconv.FormatInt(l.DeliveredBefore(e.Seq), 10))
	}
	_, _ = w.Write(e.Response)
}

// settlements reads the settlements a relay sent (an error for a
// malformed header) and keeps those that name a live entry of the ledger;
// the others (entries a cut took away) are logged and dropped.
func (g *Gateway) settlements(episode string, l *ledger.Ledger, h string) ([]ledger.Settlement, error) {
	all, err := ParseSettlements(episode, h)
	if err != nil || len(all) == 0 {
		return nil, err
	}
	keep := all[:0]
	for _, s := range all {
		if s.CallID == "" { // an answer no call of the relay read: by position
			if e, ok := l.At(s.Seq); ok {
				s.CallID = e.CallID
			}
		}
		if e, ok := l.Lookup(s.CallID); ok && e.Seq == s.Seq {
			keep = append(keep, s)
		} else {
			g.log.Warn("settlement of an entry not in the ledger: dropped", "episode", episode, "seq", s.Seq, "call", s.CallID)
		}
	}
	return keep, nil
}

// settleAlone records settlements that no entry carries and, once they
// are recorded (or there are none), says so on the answer.
func settleAlone(w http.ResponseWriter, l *ledger.Ledger, s []ledger.Settlement) error {
	if err := l.Settle(s...); err != nil {
		return err
	}
	w.Header().Set(HeaderSettledOK, "1")
	return nil
}

// serveSettle records settlements that had no call to ride on.
func (g *Gateway) serveSettle(w http.ResponseWriter, q *http.Request) {
	st, _, ok := g.admit(w, q)
	if !ok {
		return
	}
	l, err := g.ledger(st.Episode)
	if err != nil {
		g.reply(w, http.StatusInternalServerError, "server_error", err.Error())
		return
	}
	s, err := g.settlements(st.Episode, l, q.Header.Get(HeaderSettled))
	if err != nil {
		g.reply(w, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	if err := settleAlone(w, l, s); err != nil {
		g.reply(w, http.StatusConflict, "invalid_settlement", err.Error())
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (g *Gateway) forward(ctx context.Context, path string, body []byte) (int, http.Header, []byte, *[]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.up.Base+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if g.cfg.ModelKey != "" {
		req.Header.Set("Authorization", "Bearer "+g.cfg.ModelKey)
	}
	resp, err := g.up.Client.Do(req)
	if err != nil {
		return 0, nil, nil, nil, fmt.Errorf("model server %s: %w", g.up.Base, err)
	}
	defer resp.Body.Close()
	b, buf, err := readPooled(io.LimitReader(resp.Body, maxResponse+1), resp.ContentLength)
	if err != nil {
		releaseBody(buf)
		return 0, nil, nil, nil, fmt.Errorf("model server %s: read: %w", g.up.Base, err)
	}
	if len(b) > maxResponse {
		releaseBody(buf)
		return 0, nil, nil, nil, fmt.Errorf("model server answer over %d bytes", maxResponse)
	}
	return resp.StatusCode, resp.Header, b, buf, nil
}

func (g *Gateway) serveModels(w http.ResponseWriter, q *http.Request) {
	if _, ok := g.authenticate(q); !ok {
		g.m.unauthorized.Inc()
		g.reply(w, http.StatusUnauthorized, "authentication_error", "unknown or missing episode token")
		return
	}
	h := map[string]string{}
	if g.cfg.ModelKey != "" {
		h["Authorization"] = "Bearer " + g.cfg.ModelKey
	}
	proxyGet(w, q, g.up, "/v1/models", h)
}
