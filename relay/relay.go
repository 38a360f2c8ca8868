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
// delivers in that order, so the count of deliveries is the ledger cut.
package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"stasis/openapi"
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
	Logger    *slog.Logger
}

// Relay is the in-sandbox end. It implements supervisor.Gate.
type Relay struct {
	up    *Upstream
	cfg   Config
	log   *slog.Logger
	reg   *prometheus.Registry
	m     relayMetrics
	mu    sync.Mutex
	cond  *sync.Cond
	cred  Credentials
	held  bool
	gen   int   // bumped when a restore raises the attempt
	next  int64 // last call number handed out
	deliv int64 // deliveries of recorded responses (the ledger cut)
	// baseUnknown: a relaunched relay, whose deliv is set from its first
	// recorded response's ledger position.
	baseUnknown bool
	// delivering counts deliveries under way; Hold waits for zero.
	delivering int
	cancels    map[int64]context.CancelFunc // upstream calls in flight
}

type relayMetrics struct {
	calls, reissues, retries, delivered prometheus.Counter
	held                                prometheus.Gauge
	added                               prometheus.Histogram
}

// New makes a relay.
func New(cfg Config) (*Relay, error) {
	up, err := ParseUpstream(cfg.Upstream)
	if err != nil {
		return nil, err
	}
	cred, err := ReadCredentials(cfg.TokenFile)
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
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	r := &Relay{up: up, cfg: cfg, log: log, cred: cred, cancels: map[int64]context.CancelFunc{}, reg: prometheus.NewRegistry()}
	if cred.NextCall > 0 {
		r.next = cred.NextCall - 1
		r.baseUnknown = true
	}
	r.cond = sync.NewCond(&r.mu)
	f := prometheus.NewCounter
	r.m = relayMetrics{
		calls:     f(prometheus.CounterOpts{Name: "stasis_relay_calls_total", Help: "Model calls the harness made."}),
		reissues:  f(prometheus.CounterOpts{Name: "stasis_relay_reissues_total", Help: "Calls issued again after a restore."}),
		retries:   f(prometheus.CounterOpts{Name: "stasis_relay_retries_total", Help: "Upstream 429/5xx answers retried."}),
		delivered: f(prometheus.CounterOpts{Name: "stasis_relay_delivered_total", Help: "Recorded responses delivered to the harness."}),
		held:      prometheus.NewGauge(prometheus.GaugeOpts{Name: "stasis_relay_held_calls", Help: "Calls waiting on a hold."}),
		added: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "stasis_relay_added_seconds", Help: "Time a call spent in the relay beyond its upstream round trip.",
			Buckets: prometheus.ExponentialBuckets(0.00005, 2, 16)}),
	}
	r.reg.MustRegister(r.m.calls, r.m.reissues, r.m.retries, r.m.delivered, r.m.held, r.m.added)
	return r, nil
}

// Delivered is the number of recorded responses delivered so far.
func (r *Relay) Delivered() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.deliv
}

// Hold stops new upstream calls and deliveries, waits for a delivery under
// way to finish, and returns the deliveries so far.
func (r *Relay) Hold() (int64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.held = true
	for r.delivering > 0 {
		r.cond.Wait()
	}
	return r.deliv, nil
}

// Release lets calls proceed. It re-reads the token file first: a raised
// attempt means the sandbox was restored from a snapshot that kept its
// processes, so every call not yet delivered is issued again under the new
// attempt (the old upstream connections are dead, and the ledger was cut
// to the deliveries).
func (r *Relay) Release() error {
	cred, err := ReadCredentials(r.cfg.TokenFile)
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil && cred.Attempt != r.cred.Attempt {
		r.log.Info("attempt raised: re-issuing undelivered calls", "from", r.cred.Attempt, "to", cred.Attempt, "in_flight", len(r.cancels))
		r.cred = cred
		r.gen++
		for _, cancel := range r.cancels {
			cancel()
		}
		if tr, ok := r.up.Client.Transport.(*http.Transport); ok {
			tr.CloseIdleConnections()
		}
	} else if err == nil {
		r.cred.Token = cred.Token
	}
	r.held = false
	r.cond.Broadcast()
	if err != nil {
		return err
	}
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

// apiRoutes are the operations relay and gateway both serve: the two model
// calls, the models list, metrics, liveness and the OpenAPI document.
func apiRoutes(call func(http.ResponseWriter, *http.Request, string), models http.HandlerFunc, reg *prometheus.Registry, doc string) map[string]http.Handler {
	routes := map[string]http.Handler{
		"GET /v1/models":    models,
		"GET /metrics":      promhttp.HandlerFor(reg, promhttp.HandlerOpts{}),
		"GET /healthz":      http.HandlerFunc(healthz),
		"GET /openapi.json": document(doc),
	}
	for _, path := range []string{"/v1/chat/completions", "/v1/responses"} {
		routes["POST "+path] = http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) { call(w, q, path) })
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
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": http.StatusText(status)}})
	_, _ = w.Write(append(b, '\n'))
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

type result struct {
	status int
	header http.Header
	body   []byte
	buf    *[]byte // the pooled buffer body was read into, if it was
	seq    int64   // ledger position from the gateway; 0 when none
	took   time.Duration
}

func (r *Relay) serveCall(w http.ResponseWriter, q *http.Request, path string) {
	start := time.Now()
	body, bodyBuf, err := readPooled(http.MaxBytesReader(w, q.Body, r.cfg.MaxBody), q.ContentLength)
	defer releaseBody(bodyBuf) // ParseCall copies what goes upstream
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			apiError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", fmt.Sprintf("request body over %d bytes", r.cfg.MaxBody))
			return
		}
		apiError(w, http.StatusBadRequest, "invalid_request_error", "read request: "+err.Error())
		return
	}
	upBody, stream, includeUsage, err := ParseCall(body)
	if err != nil {
		apiError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	r.m.calls.Inc()
	r.mu.Lock()
	r.next++
	n := r.next
	r.mu.Unlock()
	var res result
	var upTime time.Duration
	for {
		r.mu.Lock()
		if r.held {
			r.m.held.Inc()
			for r.held {
				r.cond.Wait()
			}
			r.m.held.Dec()
		}
		gen, cred := r.gen, r.cred
		// Not the harness's context: once issued, a call runs to its end even
		// if the harness goes away, so the relay learns its ledger position
		// and keeps deliveries in ledger order. Only a restore cancels it.
		ctx, cancel := context.WithCancel(context.Background())
		r.cancels[n] = cancel
		r.mu.Unlock()

		res, err = r.issue(ctx, path, upBody, n, cred)
		cancel()
		upTime += res.took
		r.mu.Lock()
		delete(r.cancels, n)
		if r.gen != gen {
			r.mu.Unlock()
			r.m.reissues.Inc()
			continue // restored meanwhile: issue again under the new attempt
		}
		if err != nil {
			r.mu.Unlock()
			apiError(w, http.StatusBadGateway, "upstream_error", err.Error())
			return
		}
		if r.baseUnknown && res.seq > 0 && res.status/100 == 2 {
			r.deliv, r.baseUnknown = res.seq-1, false
		}
		// Wait for the hold to end and for earlier ledger entries to be
		// delivered first.
		waited := false
		for r.held || (res.seq > r.deliv+1 && r.gen == gen) {
			if !waited {
				r.m.held.Inc()
				waited = true
			}
			r.cond.Wait()
		}
		if waited {
			r.m.held.Dec()
		}
		if r.gen != gen {
			r.mu.Unlock()
			r.m.reissues.Inc()
			continue
		}
		r.delivering++
		r.mu.Unlock()
		break
	}
	r.deliver(w, path, res, stream, includeUsage)
	releaseBody(res.buf)
	r.mu.Lock()
	r.delivering--
	// A response already counted (a duplicate of a delivered entry) does
	// not move the count.
	if res.status/100 == 2 && (res.seq == 0 || res.seq == r.deliv+1) {
		r.deliv++
		r.m.delivered.Inc()
	}
	r.cond.Broadcast()
	r.mu.Unlock()
	r.m.added.Observe((time.Since(start) - upTime).Seconds())
}

func (r *Relay) deliver(w http.ResponseWriter, path string, res result, stream, includeUsage bool) {
	if res.status/100 != 2 {
		for _, h := range []string{"Content-Type", "Retry-After"} {
			if v := res.header.Get(h); v != "" {
				w.Header().Set(h, v)
			}
		}
		w.WriteHeader(res.status)
		_, _ = w.Write(res.body)
		return
	}
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(res.body)))
		_, _ = w.Write(res.body)
		return
	}
	var out []byte
	var err error
	if path == "/v1/responses" {
		out, err = ResponsesEvents(res.body)
	} else {
		out, err = ChatChunks(res.body, includeUsage)
	}
	if err != nil {
		apiError(w, http.StatusBadGateway, "upstream_error", "upstream answer is not a completion: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	_, _ = w.Write(out)
}

// issue makes one call upstream, retrying 429 and 5xx with bounded
// exponential backoff and jitter, honouring Retry-After.
func (r *Relay) issue(ctx context.Context, path string, body []byte, n int64, cred Credentials) (result, error) {
	var res result
	wait := r.cfg.Retry.Initial
	for try := 0; ; try++ {
		t0 := time.Now()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.up.Base+path, bytes.NewReader(body))
		if err != nil {
			return res, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+cred.Token)
		req.Header.Set(HeaderCallID, cred.Episode+"/"+strconv.FormatInt(n, 10))
		req.Header.Set(HeaderAttempt, strconv.Itoa(cred.Attempt))
		req.Header.Set(HeaderEpisode, cred.Episode)
		resp, err := r.up.Client.Do(req)
		if err != nil {
			res.took += time.Since(t0)
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			if try >= r.cfg.Retry.Max {
				return res, fmt.Errorf("upstream %s: %w", r.up.Base, err)
			}
			r.m.retries.Inc()
			if !sleepCtx(ctx, jitter(wait)) {
				return res, ctx.Err()
			}
			wait = min(2*wait, r.cfg.Retry.MaxInterval)
			continue
		}
		b, buf, err := readPooled(io.LimitReader(resp.Body, maxResponse+1), resp.ContentLength)
		resp.Body.Close()
		res.took += time.Since(t0)
		if err != nil {
			releaseBody(buf)
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			if try >= r.cfg.Retry.Max {
				return res, fmt.Errorf("upstream %s: read: %w", r.up.Base, err)
			}
			r.m.retries.Inc()
			if !sleepCtx(ctx, jitter(wait)) {
				return res, ctx.Err()
			}
			wait = min(2*wait, r.cfg.Retry.MaxInterval)
			continue
		}
		if len(b) > maxResponse {
			releaseBody(buf)
			return res, fmt.Errorf("upstream response over %d bytes", maxResponse)
		}
		if (resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500) && try < r.cfg.Retry.Max {
			releaseBody(buf)
			r.m.retries.Inc()
			d := jitter(wait)
			if ra := retryAfter(resp.Header.Get("Retry-After")); ra > 0 {
				d = min(ra, r.cfg.Retry.MaxInterval*6)
			}
			r.log.Debug("upstream busy, retrying", "status", resp.StatusCode, "in", d, "try", try+1)
			if !sleepCtx(ctx, d) {
				return res, ctx.Err()
			}
			wait = min(2*wait, r.cfg.Retry.MaxInterval)
			continue
		}
		res.status, res.header, res.body, res.buf = resp.StatusCode, resp.Header, b, buf
		if resp.StatusCode/100 == 2 && strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") && path == "/v1/chat/completions" {
			evs, err := ParseSSE(bytes.NewReader(b))
			if err == nil {
				res.body, err = AssembleChat(evs)
			}
			if err != nil {
				return res, fmt.Errorf("upstream stream: %w", err)
			}
		}
		if s := resp.Header.Get(HeaderLedgerSeq); s != "" {
			res.seq, _ = strconv.ParseInt(s, 10, 64)
		}
		return res, nil
	}
}

func jitter(d time.Duration) time.Duration {
	return d/2 + time.Duration(rand.Int64N(int64(d)+1))
}

func retryAfter(h string) time.Duration {
	if h == "" {
		return 0
	}
	if s, err := strconv.Atoi(strings.TrimSpace(h)); err == nil && s >= 0 {
		return time.Duration(s) * time.Second
	}
	if t, err := http.ParseTime(h); err == nil {
		return time.Until(t)
	}
	return 0
}

// sleepCtx waits d (a retry backoff) unless ctx ends first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func (r *Relay) serveModels(w http.ResponseWriter, q *http.Request) {
	r.mu.Lock()
	cred := r.cred
	r.mu.Unlock()
	proxyGet(w, q, r.up, "/v1/models", map[string]string{"Authorization": "Bearer " + cred.Token, HeaderEpisode: cred.Episode})
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
