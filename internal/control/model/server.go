// Package model is a scripted, OpenAI-compatible model server for tests,
// benchmarks and the demo.
//
// It answers POST /v1/chat/completions (streamed or not), POST /v1/responses
// (best effort), GET /v1/models, GET /healthz and GET /metrics. Its answers
// come from a Script: the turn played is the number of assistant messages
// already in the request, so a harness relaunched with its saved history gets
// the same next turn. The model is a pure function of the request body and
// the seed: the same request and seed give byte-identical responses.
//
// Every response carries token ids from a byte-level tokenizer (see
// Tokenize) the way vLLM returns them: prompt_token_ids at the top level,
// token_ids and logprobs in the choice, and usage counts that match.
//
// Faults are injected on request, deterministically: a fraction of requests
// (Options.FailRate) or one request (the X-Stasis-Fault header) fails with
// 429, 500, or a connection dropped mid-stream.
//
// A Gate (Options.Gate) holds the calls until a test lets them through, by
// count, and counts those it lets through by script and turn.
package model

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/internal/control/serve"
	"stasis/internal/eventstream"
)

// DefaultName is the model name served when Options.Name is empty.
const DefaultName = "stasis-scripted"

// DefaultMaxBody is the largest request body accepted when
// Options.MaxBodyBytes is zero; larger ones get 413.
const DefaultMaxBody = 8 << 20

// FaultHeader names a fault for one request: 429, 500, drop, or none (no
// fault, whatever the fail rate).
const FaultHeader = "X-Stasis-Fault"

// Options configure a Server.
type Options struct {
	Script *Script // nil: DefaultScript()
	// Scripts are played instead of Script for conversations they match
	// (Script.Match); Script plays the rest.
	Scripts      []*Script
	Seed         int64         // varies ids, created and logprobs
	TokenDelay   time.Duration // sleep per generated token
	FailRate     float64       // fraction of requests that fail, 0 to 1
	Name         string        // model name in /v1/models; "" means DefaultName
	MaxBodyBytes int64         // 0 means DefaultMaxBody
	Logger       *slog.Logger  // nil: discard
	// Gate, when set, holds every chat and responses call until it lets
	// the call through (tests: see Gate).
	Gate *Gate
}

// Server is the scripted model; it is an http.Handler.
type Server struct {
	script  *Script
	scripts []*Script
	seed    int64
	delay   time.Duration
	rate    float64
	name    string
	maxBody int64
	created int64
	log     *slog.Logger
	gate    *Gate

	mu       sync.Mutex
	attempts map[[32]byte]uint64 // per distinct request, for rate faults
	metrics  metrics
}

// New returns a Server. A nil Script plays DefaultScript; a FailRate outside
// [0, 1] is clamped.
func New(o Options) *Server {
	s := &Server{
		script: o.Script, scripts: o.Scripts, seed: o.Seed, delay: o.TokenDelay, rate: o.FailRate,
		name: o.Name, maxBody: o.MaxBodyBytes, log: o.Logger, gate: o.Gate,
		attempts: map[[32]byte]uint64{},
	}
	if s.script == nil || len(s.script.Turns) == 0 {
		s.script = DefaultScript()
	}
	if s.name == "" {
		s.name = DefaultName
	}
	if s.maxBody <= 0 {
		s.maxBody = DefaultMaxBody
	}
	s.rate = min(max(s.rate, 0), 1)
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	// A fixed creation time per seed, in 2025, never the wall clock.
	s.created = 1735689600 + int64(uint64(o.Seed)%31536000)
	s.metrics.init()
	return s
}

// Handler returns s, for symmetry with servers that wrap theirs.
func (s *Server) Handler() http.Handler { return s }

// Name is the model name the server lists.
func (s *Server) Name() string { return s.name }

// ServeHTTP routes a request.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Clients configured without the /v1 of the base URL work too.
	path := strings.TrimPrefix(strings.TrimSuffix(r.URL.Path, "/"), "/v1")
	rec := &recorder{StatusRecorder: serve.StatusRecorder{ResponseWriter: w}}
	endpoint := "other"
	switch path {
	case "/chat/completions":
		endpoint = "chat_completions"
		if s.allow(rec, r, http.MethodPost) {
			s.serveChat(rec, r)
		}
	case "/responses":
		endpoint = "responses"
		if s.allow(rec, r, http.MethodPost) {
			s.serveResponses(rec, r)
		}
	case "/models":
		endpoint = "models"
		if s.allow(rec, r, http.MethodGet) {
			s.serveModels(rec)
		}
	case "/healthz":
		endpoint = "healthz"
		if s.allow(rec, r, http.MethodGet) {
			rec.Header().Set("Content-Type", "text/plain; charset=utf-8")
			_, _ = io.WriteString(rec, "ok\n")
		}
	case "/metrics":
		endpoint = "metrics"
		if s.allow(rec, r, http.MethodGet) {
			s.serveMetrics(rec)
		}
	default:
		writeError(rec, http.StatusNotFound, "invalid_request_error", "not_found",
			fmt.Sprintf("no such endpoint %s %s: use POST /v1/chat/completions, POST /v1/responses or GET /v1/models", r.Method, r.URL.Path))
	}
	code := strconv.Itoa(rec.Status())
	if rec.dropped {
		code = "dropped"
	}
	s.metrics.request(endpoint, code)
}

func (s *Server) allow(w http.ResponseWriter, r *http.Request, method string) bool {
	if r.Method == method || (method == http.MethodGet && r.Method == http.MethodHead) {
		return true
	}
	w.Header().Set("Allow", method)
	writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed",
		fmt.Sprintf("%s %s is not allowed: use %s", r.Method, r.URL.Path, method))
	return false
}

// recorder remembers the status written, and whether the connection was
// dropped on purpose.
type recorder struct {
	serve.StatusRecorder
	dropped bool
}

// APIError is the OpenAI error shape: {"error": {...}}.
type APIError struct {
	Error APIErrorBody `json:"error"`
}

// APIErrorBody is the inside of an APIError.
type APIErrorBody struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

func writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	b, _ := json.Marshal(APIError{Error: APIErrorBody{Message: msg, Type: typ, Code: code}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

func writeJSON(w http.ResponseWriter, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "server_error", "internal_error", "encoding the response: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	_, _ = w.Write(append(b, '\n'))
}

// readBody reads a request body up to the limit, answering 413 or 400 itself
// when it cannot.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.maxBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large",
				fmt.Sprintf("the request body is over %d bytes: send a shorter conversation", s.maxBody))
			return nil, false
		}
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_body", "reading the request body: "+err.Error())
		return nil, false
	}
	return body, true
}

// readRequest reads a request body and parses it, answering 400 itself
// when it does not parse.
func readRequest[T any](s *Server, w http.ResponseWriter, r *http.Request, parse func([]byte) (T, error)) (body []byte, req T, ok bool) {
	body, ok = s.readBody(w, r)
	if !ok {
		return nil, req, false
	}
	req, err := parse(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_request", err.Error())
		return nil, req, false
	}
	return body, req, true
}

// A fault is what goes wrong with one request.
type fault string

const (
	faultNone fault = ""
	fault429  fault = "429"
	fault500  fault = "500"
	faultDrop fault = "drop"
)

// call is a parsed chat or responses call, and how its reply is made.
type call struct {
	api    string // "chat" or "responses", a part of the request key
	logMsg string
	body   []byte
	conv   *conversation
	model  string // as the request names it
	stream bool
	// events makes the streamed reply, whole the reply in one body.
	events func(g *generation, model string) []event
	whole  func(g *generation, model string) any
}

// answer draws the call's fault, and unless the fault is the whole
// answer (an error, or a drop of a call that does not stream) generates
// the reply and sends it.
func (s *Server) answer(w http.ResponseWriter, r *http.Request, c call) {
	if s.gate != nil && !s.gate.pass(r.Context(), s.scriptFor(c.conv).Name, c.conv.assistant) {
		return // the client went while the call was held
	}
	key := requestKey(s.seed, c.api, c.body)
	f, draw, ok := s.pickFault(w, r, key)
	if !ok || s.injectError(w, f) {
		return
	}
	if f == faultDrop && !c.stream {
		s.metrics.fault(string(f))
		drop(w)
		return
	}
	model := c.model
	if model == "" {
		model = s.name
	}
	g := s.generate(c.conv, key)
	s.metrics.tokens(len(g.promptIDs), len(g.ids))
	s.log.Debug(c.logMsg, "turn", g.turn, "calls", len(g.calls), "prompt_tokens", len(g.promptIDs), "completion_tokens", len(g.ids), "stream", c.stream, "fault", string(f))
	if c.stream {
		s.stream(w, r, c.events(g, model), f, draw)
		return
	}
	if err := s.sleepTokens(r, len(g.ids)); err != nil {
		return
	}
	writeJSON(w, c.whole(g, model))
}

// pickFault decides the request's fault: the header's, or, at the fail rate,
// one drawn from the seed, the request and how many times this very request
// was seen before (so a retried request can succeed). ok is false when the
// header is malformed (the error is written).
func (s *Server) pickFault(w http.ResponseWriter, r *http.Request, key [32]byte) (fault, uint64, bool) {
	var attempt uint64
	if s.rate > 0 {
		s.mu.Lock()
		if len(s.attempts) >= 1<<20 {
			s.attempts = map[[32]byte]uint64{} // bound the memory of long benchmarks
		}
		attempt = s.attempts[key]
		s.attempts[key] = attempt + 1
		s.mu.Unlock()
	}
	h := sha256.New()
	h.Write(key[:])
	h.Write([]byte("fault"))
	_ = binary.Write(h, binary.LittleEndian, attempt)
	sum := h.Sum(nil)
	draw := binary.LittleEndian.Uint64(sum[8:16])
	switch v := strings.ToLower(strings.TrimSpace(r.Header.Get(FaultHeader))); v {
	case "":
	case "none":
		return faultNone, draw, true
	case string(fault429), string(fault500), string(faultDrop):
		return fault(v), draw, true
	default:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "invalid_fault",
			fmt.Sprintf("%s: %q is not a fault: use 429, 500, drop or none", FaultHeader, v))
		return faultNone, 0, false
	}
	if s.rate == 0 {
		return faultNone, draw, true
	}
	u := float64(binary.LittleEndian.Uint64(sum[0:8])>>11) / (1 << 53)
	if u >= s.rate {
		return faultNone, draw, true
	}
	return []fault{fault429, fault500, faultDrop}[sum[16]%3], draw, true
}

// injectError answers a 429 or 500 fault; it reports whether it did.
func (s *Server) injectError(w http.ResponseWriter, f fault) bool {
	switch f {
	case fault429:
		s.metrics.fault(string(f))
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusTooManyRequests, "rate_limit_error", "rate_limit_exceeded",
			"injected fault: rate limit reached; retry after 1 second")
		return true
	case fault500:
		s.metrics.fault(string(f))
		writeError(w, http.StatusInternalServerError, "server_error", "internal_error",
			"injected fault: the model server failed; retry the request")
		return true
	}
	return false
}

// drop closes the client's connection without finishing the response.
func drop(w http.ResponseWriter) {
	if rec, ok := w.(*recorder); ok {
		rec.dropped = true
	}
	// Hijack sends what was written so far (a stream's chunks), nothing more.
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		// HTTP/2, or a writer that cannot hijack: abort the handler, which
		// resets the stream or closes the connection.
		panic(http.ErrAbortHandler)
	}
	_ = conn.Close()
}

// sleepTokens waits the token delay for n tokens, or until the client goes.
func (s *Server) sleepTokens(r *http.Request, n int) error {
	if s.delay <= 0 || n <= 0 {
		return nil
	}
	t := time.NewTimer(s.delay * time.Duration(n))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-r.Context().Done():
		return r.Context().Err()
	}
}

// ModelList is the body of GET /v1/models.
type ModelList struct {
	Object string      `json:"object"`
	Data   []ModelInfo `json:"data"`
}

// ModelInfo is one model of a ModelList.
type ModelInfo struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

func (s *Server) serveModels(w http.ResponseWriter) {
	writeJSON(w, ModelList{Object: "list", Data: []ModelInfo{{ID: s.name, Object: "model", Created: s.created, OwnedBy: "stasis"}}})
}

// event is one prepared server-sent event and the tokens it carries.
type event struct {
	data   []byte
	tokens int
}

// stream sends events with the token delay; with a drop fault it cuts the
// connection after some of them, never after the last.
func (s *Server) stream(w http.ResponseWriter, r *http.Request, events []event, f fault, draw uint64) {
	cut := len(events) + 1
	if f == faultDrop {
		s.metrics.fault(string(f))
		// 1 <= cut <= len-2: at least one event goes out, the end never does.
		cut = 1 + int(draw%uint64(max(1, len(events)-2)))
	}
	out := eventstream.Start(w)
	for i, ev := range events {
		if i == cut {
			drop(w)
			return
		}
		if err := s.sleepTokens(r, ev.tokens); err != nil {
			return
		}
		if err := out.Write(ev.data); err != nil {
			return
		}
	}
}

func sseData(v any) []byte {
	b, _ := json.Marshal(v)
	return append(append([]byte("data: "), b...), '\n', '\n')
}

func sseEvent(name string, v any) []byte {
	b, _ := json.Marshal(v)
	return append(append([]byte("event: "+name+"\ndata: "), b...), '\n', '\n')
}
