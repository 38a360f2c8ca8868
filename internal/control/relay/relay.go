// Package relay owns the path of model calls between a harness and the
// policy model: the Relay, which lives inside the sandbox (hosted by the
// supervisor so a pause gates it directly), and the Gateway on the host,
// which authenticates episodes, refuses stale attempts, records every call
// in the episode's ledger and forwards it to the model server.
//
// The relay stores and forwards: it asks upstream for a whole response
// (stream false), and hands it to the harness only once it holds all of it,
// re-chunked as server-sent events when the harness asked for a stream. So
// a delivery is one short local write, and a pause can wait for it. Each
// call gets a call id, EPISODE/N, stable across re-issues; it travels with
// the episode's attempt in headers, and the bearer token the harness never
// sees. The gateway answers with the entry's ledger position, and the relay
// settles entries in that order: each is delivered (written whole and
// flushed to a live connection) or abandoned (its client had gone), and the
// relay tells the gateway which, so the ledger records it. The settled
// position is the ledger cut of an in-place restore; the deliveries are
// what the harness received. A streaming client gets its headers at once
// and heartbeats while its response is stored or held.
package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"stasis/internal/control/openapi"
	"stasis/internal/insandbox/supervisor"
)

// Headers between relay and gateway.
const (
	HeaderCallID    = "X-Stasis-Call-Id"
	HeaderAttempt   = "X-Stasis-Attempt"
	HeaderEpisode   = "X-Stasis-Episode"
	HeaderLedgerSeq = "X-Stasis-Ledger-Seq"
	HeaderDedupe    = "X-Stasis-Dedupe"
)

// DefaultMaxBody bounds a request body.
const DefaultMaxBody = 8 << 20

// maxResponse bounds a response body read from upstream.
const maxResponse = 64 << 20

// Credentials are what the relay sends upstream: DIR/token file contents,
// written by the host. On a restore the host rewrites the file (a new
// attempt) before the continue.
type Credentials struct {
	Episode string `json:"episode"`
	Token   string `json:"token"`
	Attempt int    `json:"attempt"`
	// Upstream, when set, is the gateway's URL as this sandbox reaches it
	// now: the host writes it with each attempt, and a relay that already
	// runs (a sandbox resumed in place, perhaps on another node, whose
	// gateway is elsewhere) sends its calls there from the continue on.
	// Empty: the relay's configured upstream.
	Upstream string `json:"upstream,omitempty"`
	// NextCall numbers the first call of a relaunched relay after the
	// calls already in the ledger (0: start at 1). A relay started with
	// NextCall set is a relaunch: it does not know where in the ledger its
	// harness resumes until the gateway has matched the first call, so it
	// takes its delivered count from that call's ledger position.
	NextCall int64 `json:"next_call,omitempty"`
}

// ReadCredentials reads a token file.
func ReadCredentials(path string) (Credentials, error) {
	var c Credentials
	b, err := os.ReadFile(path)
	if err != nil {
		return c, fmt.Errorf("relay token file: %w", err)
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return c, fmt.Errorf("relay token file %s: %w", path, err)
	}
	if c.Episode == "" || c.Token == "" || c.Attempt < 0 {
		return c, fmt.Errorf("relay token file %s: needs episode, token and attempt", path)
	}
	return c, nil
}

// Retry bounds the retries of upstream 429 and 5xx answers.
type Retry struct {
	Max         int           // attempts after the first (default 6)
	Initial     time.Duration // first backoff (default 200ms)
	MaxInterval time.Duration // cap (default 10s)
}

// Config configures a Relay.
type Config struct {
	Upstream  string
	TokenFile string
	MaxBody   int64
	Retry     Retry
	// Heartbeat is how often a streaming client waiting for its stored or
	// held response gets an SSE comment (default 5s).
	Heartbeat time.Duration
	// SettleDelay is how long a settlement may wait to ride on the next
	// call to the gateway before it is sent on its own (default 50ms).
	SettleDelay time.Duration
	Logger      *slog.Logger
	// Clock is the relay's time (nil: the system's).
	Clock Clock
}

// DefaultHeartbeat is Config.Heartbeat's default.
const DefaultHeartbeat = 5 * time.Second

// Relay is the in-sandbox end. It implements supervisor.Gate.
type Relay struct {
	up    atomic.Pointer[Upstream] // where calls go; the token file may move it (Release)
	cfg   Config
	clock Clock
	log   *slog.Logger
	reg   *prometheus.Registry
	m     relayMetrics

	mu sync.Mutex
	// changed is closed (and replaced) whenever the state below changes;
	// waiters select on it with their client's context and a heartbeat.
	changed chan struct{}
	cred    Credentials
	order   *order                       // the delivery order, which decides
	out     outbox                       // settlements the gateway has not recorded yet
	cancels map[int64]context.CancelFunc // upstream calls in flight
}

type relayMetrics struct {
	calls, reissues, retries, delivered, abandoned, dropped, heartbeats prometheus.Counter
	held                                                                prometheus.Gauge
	added                                                               prometheus.Histogram
}

// New makes a relay.
func New(cfg Config) (*Relay, error) {
	cred, err := ReadCredentials(cfg.TokenFile)
	if err != nil {
		return nil, err
	}
	if cred.Upstream != "" {
		cfg.Upstream = cred.Upstream
	}
	up, err := ParseUpstream(cfg.Upstream)
	if err != nil {
		return nil, err
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	if cfg.Retry.Max == 0 {
		cfg.Retry.Max = 6
	}
	if cfg.Retry.Initial == 0 {
		cfg.Retry.Initial = 200 * time.Millisecond
	}
	if cfg.Retry.MaxInterval == 0 {
		cfg.Retry.MaxInterval = 10 * time.Second
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.SettleDelay <= 0 {
		cfg.SettleDelay = 50 * time.Millisecond
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	r := &Relay{cfg: cfg, clock: clockOr(cfg.Clock), log: log, cred: cred, order: newOrder(cred.NextCall),
		cancels: map[int64]context.CancelFunc{}, reg: prometheus.NewRegistry(), changed: make(chan struct{})}
	r.up.Store(up)
	f := prometheus.NewCounter
	r.m = relayMetrics{
		calls:      f(prometheus.CounterOpts{Name: "stasis_relay_calls_total", Help: "Model calls the harness made."}),
		reissues:   f(prometheus.CounterOpts{Name: "stasis_relay_reissues_total", Help: "Calls issued again after a restore."}),
		retries:    f(prometheus.CounterOpts{Name: "stasis_relay_retries_total", Help: "Upstream 429/5xx answers retried."}),
		delivered:  f(prometheus.CounterOpts{Name: "stasis_relay_delivered_total", Help: "Recorded responses written whole and flushed to a live connection."}),
		abandoned:  f(prometheus.CounterOpts{Name: "stasis_relay_abandoned_total", Help: "Recorded responses whose client had gone (timed out, disconnected) before it got them."}),
		dropped:    f(prometheus.CounterOpts{Name: "stasis_relay_dropped_total", Help: "Calls whose client had gone before they were sent upstream (never sent)."}),
		heartbeats: f(prometheus.CounterOpts{Name: "stasis_relay_heartbeats_total", Help: "SSE comments sent to streaming clients while their response was stored or held."}),
		held:       prometheus.NewGauge(prometheus.GaugeOpts{Name: "stasis_relay_held_calls", Help: "Calls waiting on a hold."}),
		added: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "stasis_relay_added_seconds", Help: "Time a call spent in the relay beyond its upstream round trip.",
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16)}),
	}
	r.reg.MustRegister(r.m.calls, r.m.reissues, r.m.retries, r.m.delivered, r.m.abandoned, r.m.dropped, r.m.heartbeats, r.m.held, r.m.added)
	return r, nil
}

// broadcastLocked wakes every waiter; r.mu is held.
func (r *Relay) broadcastLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// waitLocked waits, with r.mu held (it is released while waiting), for
// the next change. It returns false if done (nil: never) is closed first.
func (r *Relay) waitLocked(done <-chan struct{}) bool {
	ch := r.changed
	r.mu.Unlock()
	defer r.mu.Lock()
	select {
	case <-ch:
		return true
	case <-done:
		return false
	}
}

// Delivered is the number of recorded responses delivered so far.
func (r *Relay) Delivered() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.order.deliv
}

// Position is the ledger position up to which every recorded response is
// settled, delivered or abandoned.
func (r *Relay) Position() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.order.pos
}

// holdFlushTimeout bounds how long a hold waits for the gateway to record
// the settlements not yet sent.
const holdFlushTimeout = 10 * time.Second

// Hold stops new upstream calls and deliveries, waits for a delivery under
// way to finish, has the gateway record every settlement so far (so the
// ledger says which responses the harness got), and returns the deliveries
// and the settled position.
func (r *Relay) Hold() (supervisor.Held, error) {
	r.mu.Lock()
	r.order.hold()
	r.broadcastLocked()
	for !r.order.idle() {
		r.waitLocked(nil)
	}
	h := supervisor.Held{Delivered: r.order.deliv, Position: r.order.pos, Unmatched: r.order.wantsBase()}
	r.mu.Unlock()
	ctx, cancel := withTimeout(context.Background(), r.clock, holdFlushTimeout)
	defer cancel()
	if err := r.flushSettlements(ctx, true); err != nil {
		// The ledger lacks these dispositions (its entries read pending);
		// the position in the acknowledgement is what the cut uses.
		r.log.Warn("hold: the gateway did not record the latest settlements", "err", err)
	}
	return h, nil
}

// Flush waits for a delivery under way to be settled, then has the gateway
// record every settlement not yet recorded (those riding on calls in
// flight too), retrying until ctx ends.
func (r *Relay) Flush(ctx context.Context) error {
	r.mu.Lock()
	for !r.order.idle() {
		if !r.waitLocked(ctx.Done()) {
			r.mu.Unlock()
			return fmt.Errorf("a delivery to the harness did not finish: %w", ctx.Err())
		}
	}
	r.mu.Unlock()
	return r.flushSettlements(ctx, true)
}

// Release lets calls proceed. It re-reads the token file first: a raised
// attempt means the sandbox was restored from a snapshot that kept its
// processes, so every call not yet delivered is issued again under the new
// attempt (the old upstream connections are dead, and the ledger was cut
// to the settled position); a new upstream there (the episode resumed on
// another node) takes every call from now on.
func (r *Relay) Release() error {
	cred, err := ReadCredentials(r.cfg.TokenFile)
	var moved error
	if err == nil {
		moved = r.moveUpstream(cred.Upstream)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil && cred.Attempt != r.cred.Attempt {
		r.log.Info("attempt raised: re-issuing undelivered calls", "from", r.cred.Attempt, "to", cred.Attempt, "in_flight", len(r.cancels))
		r.cred = cred
		r.order.raise()
		for _, cancel := range r.cancels {
			cancel()
		}
		if tr, ok := r.up.Load().Client.Transport.(*http.Transport); ok {
			tr.CloseIdleConnections()
		}
	} else if err == nil {
		r.cred.Token = cred.Token
	}
	r.order.release()
	r.broadcastLocked()
	if err != nil {
		return err
	}
	if r.out.pending() {
		r.scheduleFlushLocked()
	}
	return moved
}

// moveUpstream sends calls to raw from now on, when it is set and not
// where they go already. A URL that does not parse moves nothing: the
// calls keep their upstream, and the error says why.
func (r *Relay) moveUpstream(raw string) error {
	old := r.up.Load()
	if raw == "" || raw == old.Raw {
		return nil
	}
	up, err := ParseUpstream(raw)
	if err != nil {
		return fmt.Errorf("relay token file %s: upstream: %w", r.cfg.TokenFile, err)
	}
	r.up.Store(up)
	if tr, ok := old.Client.Transport.(*http.Transport); ok {
		tr.CloseIdleConnections()
	}
	r.log.Info("upstream moved", "from", old.Raw, "to", raw)
	return nil
}

// Handler serves the harness: the OpenAI-compatible endpoints, /metrics and
// /healthz.
func (r *Relay) Handler() http.Handler { return mux(r.routes()) }

// Routes lists the operations the handler serves ("METHOD /path"); a test
// checks them against the OpenAPI document.
func (r *Relay) Routes() []string { return keys(r.routes()) }

func (r *Relay) routes() map[string]http.Handler {
	return apiRoutes(r.serveCall, r.serveModels, r.reg, openapi.Relay)
}

// apiRoutes are the operations relay and gateway both serve: every POST
// under /v1 (the model calls: chat completions and responses, streamed or
// not, and any other model endpoint, recorded alike), the same two calls
// without the /v1 (for clients whose base URL lacks it), the models list,
// metrics, liveness and the OpenAPI document.
func apiRoutes(call func(http.ResponseWriter, *http.Request, string), models http.HandlerFunc, reg *prometheus.Registry, doc string) map[string]http.Handler {
	routes := map[string]http.Handler{
		"GET /v1/models":    models,
		"GET /models":       models,
		"GET /metrics":      promhttp.HandlerFor(reg, promhttp.HandlerOpts{}),
		"GET /healthz":      http.HandlerFunc(healthz),
		"GET /openapi.json": document(doc),
		"POST /v1/{endpoint...}": http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
			call(w, q, "/v1/"+q.PathValue("endpoint"))
		}),
	}
	for _, path := range []string{"/chat/completions", "/responses"} {
		h := http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) { call(w, q, "/v1"+path) })
		routes["POST "+path], routes["POST /v1"+path] = h, h
	}
	return routes
}

func mux(routes map[string]http.Handler) http.Handler {
	m := http.NewServeMux()
	for pattern, h := range routes {
		m.Handle(pattern, h)
	}
	return m
}

func keys(routes map[string]http.Handler) []string {
	out := make([]string, 0, len(routes))
	for k := range routes {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func healthz(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") }

func document(name string) http.Handler {
	b := openapi.Raw(name)
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(b)
	})
}

// apiError writes an error in the OpenAI shape.
func apiError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(errorJSON(typ, http.StatusText(status), msg), '\n'))
}

// errorJSON is an error body in the OpenAI shape.
func errorJSON(typ, code, msg string) []byte {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": code}})
	return b
}

// ParseCall reads what the relay needs from a call's body: whether the
// harness wants a stream (and usage in it), and the body to send upstream.
// The upstream body is the harness's, byte for byte, except that the
// top-level "stream" is false and "stream_options" is gone: the members are
// cut out by their offsets rather than the whole body re-encoded, so unknown
// fields, their order and their number formats pass through untouched, and
// a large conversation costs one validating scan (json.Valid) and one walk
// over its top-level members.
func ParseCall(body []byte) (upstream []byte, stream, includeUsage bool, err error) {
	if up, stream, includeUsage, ok := parseCallFast(body); ok {
		return up, stream, includeUsage, nil
	}
	return parseCallJSON(body)
}

// span is a member of the request's top-level object, with the separator
// before it: the bytes from the end of the previous member (or the '{')
// to the end of its value.
type span struct{ from, to int64 }

// parseCallFast is ParseCall in one validating pass and one walk over the
// top-level members, without decoding any value but "stream" and
// "stream_options". ok is false for a body it leaves to parseCallJSON,
// which says what is wrong with it: one that is not a JSON object, a key
// with an escape in it, a "stream" that is not true, false or null.
func parseCallFast(body []byte) (upstream []byte, stream, includeUsage bool, ok bool) {
	if !json.Valid(body) {
		return nil, false, false, false
	}
	i := skipWS(body, 0)
	if i >= len(body) || body[i] != '{' {
		return nil, false, false, false
	}
	var cutBuf [2]span
	cut := cutBuf[:0]
	i++
	prevEnd := i
	for {
		i = skipWS(body, i)
		if body[i] == '}' {
			break
		}
		if body[i] == ',' {
			i = skipWS(body, i+1)
		}
		// A key (valid JSON: a string, then ':').
		k := i + 1
		for body[k] != '"' {
			if body[k] == '\\' {
				return nil, false, false, false // escaped: the decoder unescapes it
			}
			k++
		}
		key := body[i+1 : k]
		from := skipWS(body, skipWS(body, k+1)+1) // past ':'
		end := skipJSON(body, from)
		switch string(key) {
		case "stream":
			switch string(body[from:end]) {
			case "true":
				stream = true
			case "false":
				stream = false
			case "null": // json.Unmarshal leaves the bool as it was
			default:
				return nil, false, false, false
			}
			cut = append(cut, span{int64(prevEnd), int64(end)})
		case "stream_options":
			var opts struct {
				IncludeUsage bool `json:"include_usage"`
			}
			_ = json.Unmarshal(body[from:end], &opts)
			includeUsage = opts.IncludeUsage
			cut = append(cut, span{int64(prevEnd), int64(end)})
		}
		prevEnd, i = end, end
	}
	return splice(body, cut), stream, includeUsage, true
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipJSON returns the end of the value starting at b[i], in JSON known to
// be valid.
func skipJSON(b []byte, i int) int {
	depth := 0
	for ; i < len(b); i++ {
		switch b[i] {
		case '"':
			for i++; b[i] != '"'; i++ {
				if b[i] == '\\' {
					i++
				}
			}
			if depth == 0 {
				return i + 1
			}
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i // the end of the object holding a number or literal
			}
			if depth--; depth == 0 {
				return i + 1
			}
		case ',', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i
			}
		}
	}
	return i
}

// parseCallJSON is ParseCall by encoding/json's decoder: the reference
// parseCallFast is tested against, and what says what is wrong with a body.
func parseCallJSON(body []byte) (upstream []byte, stream, includeUsage bool, err error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, false, false, fmt.Errorf("request body must be a JSON object")
	}
	var cut []span
	prevEnd := dec.InputOffset() // just after '{' or after the previous member
	for dec.More() {
		kt, err := dec.Token()
		if err != nil {
			return nil, false, false, fmt.Errorf("request body must be a JSON object: %v", err)
		}
		key, _ := kt.(string)
		var val json.RawMessage
		if err := dec.Decode(&val); err != nil {
			return nil, false, false, fmt.Errorf("request body must be a JSON object: %v", err)
		}
		end := dec.InputOffset()
		switch key {
		case "stream":
			if err := json.Unmarshal(val, &stream); err != nil {
				return nil, false, false, fmt.Errorf("\"stream\" must be true or false")
			}
			cut = append(cut, span{prevEnd, end})
		case "stream_options":
			var opts struct {
				IncludeUsage bool `json:"include_usage"`
			}
			_ = json.Unmarshal(val, &opts)
			includeUsage = opts.IncludeUsage
			cut = append(cut, span{prevEnd, end})
		}
		prevEnd = end
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, false, false, fmt.Errorf("request body must be a JSON object")
	}
	if dec.More() {
		return nil, false, false, fmt.Errorf("request body must be one JSON object")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false, false, fmt.Errorf("request body must be one JSON object")
	}
	return splice(body, cut), stream, includeUsage, nil
}

// splice returns body, a JSON object, without the members cut and with
// "stream":false as its first member.
func splice(body []byte, cut []span) []byte {
	// Splice: drop the cut members (each span starts at the separator
	// before its key), then add "stream":false as the first member.
	out := make([]byte, 0, len(body)+16)
	open := bytes.IndexByte(body, '{')
	out = append(out, body[:open+1]...)
	out = append(out, `"stream":false`...)
	rest := body[open+1:]
	base := int64(open + 1)
	pos := int64(0)
	var kept []byte
	for _, c := range cut {
		kept = append(kept, rest[pos:c.from-base]...)
		pos = c.to - base
	}
	kept = append(kept, rest[pos:]...)
	// kept is the members after '{' (with their separators) and the closing
	// '}': it may start with a ',' (a cut first member left the next one's
	// comma) or with the first member itself.
	t := bytes.TrimLeft(kept, " \t\r\n")
	switch {
	case len(t) > 0 && t[0] == '}':
		out = append(out, kept...)
	case len(t) > 0 && t[0] == ',':
		out = append(out, kept...)
	default:
		out = append(out, ',')
		out = append(out, kept...)
	}
	return out
}

func jitter(d time.Duration) time.Duration {
	return d/2 + time.Duration(rand.Int64N(int64(d)+1))
}

func (r *Relay) serveModels(w http.ResponseWriter, q *http.Request) {
	r.mu.Lock()
	cred := r.cred
	r.mu.Unlock()
	proxyGet(w, q, r.up.Load(), "/v1/models", map[string]string{"Authorization": "Bearer " + cred.Token, HeaderEpisode: cred.Episode})
}

// proxyGet answers a GET with the upstream's answer to the same GET.
func proxyGet(w http.ResponseWriter, q *http.Request, up *Upstream, path string, header map[string]string) {
	req, err := http.NewRequestWithContext(q.Context(), http.MethodGet, up.Base+path, nil)
	if err != nil {
		apiError(w, http.StatusInternalServerError, "server_error", err.Error())
		return
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := up.Client.Do(req)
	if err != nil {
		apiError(w, http.StatusBadGateway, "upstream_error", err.Error())
		return
	}
	defer resp.Body.Close()
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, io.LimitReader(resp.Body, maxResponse))
}
