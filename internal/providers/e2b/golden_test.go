package e2b_test

// The client held to the golden bodies of testdata/golden (written from
// E2B's specifications, see its README): a plain httptest server, not the
// fake, answers with the golden responses and records what the provider
// sends, which must match the golden requests. The fake is held to the
// same files in internal/providers/e2b/e2bfake.

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/golden"
	"stasis/internal/providers/e2b"
	"stasis/sandbox"
)

// goldenNow is the provider's clock in these tests: the timeouts and
// expiries of the golden requests are computed from it.
var goldenNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

const goldenKey = "e2b_0123456789abcdef"

// call is one request the stub received.
type call struct {
	Method, Path string
	Query        url.Values
	Header       http.Header
	Body         []byte
	Envd         bool
}

// stub is the plain server: the API and envd (told apart by the
// E2b-Sandbox-Id header, as the provider's EnvdURL mode routes) on one
// handler, each a ServeMux of the test's handlers.
type stub struct {
	t    *testing.T
	g    *golden.Set
	api  *http.ServeMux
	envd *http.ServeMux
	srv  *httptest.Server
	quit chan struct{} // closed when the test ends: held streams let go

	mu  sync.Mutex
	log []call
}

func newStub(t *testing.T) *stub {
	t.Helper()
	s := &stub{t: t, g: golden.MustLoad(t, "testdata/golden"), api: http.NewServeMux(), envd: http.NewServeMux(), quit: make(chan struct{})}
	s.srv = httptest.NewServer(s)
	t.Cleanup(s.srv.Close)
	t.Cleanup(func() { close(s.quit) }) // runs first
	return s
}

func (s *stub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(b))
	envd := r.Header.Get("E2b-Sandbox-Id") != ""
	s.mu.Lock()
	s.log = append(s.log, call{Method: r.Method, Path: r.URL.Path, Query: r.URL.Query(), Header: r.Header.Clone(), Body: b, Envd: envd})
	s.mu.Unlock()
	mux := s.api
	if envd {
		mux = s.envd
	}
	if _, pattern := mux.Handler(r); pattern == "" {
		s.t.Errorf("the provider called %s %s (envd %v), which this test does not expect", r.Method, r.URL.Path, envd)
		http.Error(w, "unexpected", http.StatusTeapot)
		return
	}
	mux.ServeHTTP(w, r)
}

// calls are the requests received for a method and path.
func (s *stub) calls(method, path string) []call {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []call
	for _, c := range s.log {
		if c.Method == method && c.Path == path {
			out = append(out, c)
		}
	}
	return out
}

// one is the only request for a method and path.
func (s *stub) one(method, path string) call {
	s.t.Helper()
	cs := s.calls(method, path)
	if len(cs) != 1 {
		s.t.Fatalf("%d requests %s %s, want 1", len(cs), method, path)
	}
	return cs[0]
}

// reply answers with a status and a golden body ("" for none).
func (s *stub) reply(status int, name string) http.HandlerFunc {
	var body []byte
	if name != "" {
		body = s.g.Bytes(s.t, name)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if body != nil {
			w.Header().Set("Content-Type", "application/json")
		}
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}
}

// envelope frames a Connect stream message (connectrpc.com
// docs/protocol.md, Streaming-Request: flags, big-endian length, message).
func envelope(flags byte, msg []byte) []byte {
	out := make([]byte, 5, 5+len(msg))
	out[0] = flags
	binary.BigEndian.PutUint32(out[1:], uint32(len(msg)))
	return append(out, msg...)
}

// unenvelope reads the one message of a streaming request's body.
func unenvelope(t *testing.T, b []byte) []byte {
	t.Helper()
	if len(b) < 5 || b[0] != 0 || int(binary.BigEndian.Uint32(b[1:5])) != len(b)-5 {
		t.Fatalf("not one Connect envelope with flags 0: %q", b)
	}
	return b[5:]
}

// stream answers Start with the golden stream's messages, each in its
// envelope, then the golden end-of-stream message (flag 0x02). Before the
// message at index holdAt it waits for hold to be closed (or the client to
// go away, which ends the stream there).
func (s *stub) stream(streamFile, endFile string, holdAt int, hold <-chan struct{}) http.HandlerFunc {
	var msgs []json.RawMessage
	if streamFile != "" {
		if err := json.Unmarshal(s.g.Bytes(s.t, streamFile), &msgs); err != nil {
			s.t.Fatal(err)
		}
	}
	end := s.g.Bytes(s.t, endFile)
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/connect+json")
		w.WriteHeader(http.StatusOK)
		fl := w.(http.Flusher)
		for i, m := range msgs {
			if i == holdAt {
				fl.Flush()
				select {
				case <-hold:
				case <-r.Context().Done():
					return
				case <-s.quit:
					return
				}
			}
			var compact bytes.Buffer
			_ = json.Compact(&compact, m)
			_, _ = w.Write(envelope(0, compact.Bytes()))
		}
		var compact bytes.Buffer
		_ = json.Compact(&compact, end)
		_, _ = w.Write(envelope(0x02, compact.Bytes()))
	}
}

func (s *stub) provider(t *testing.T) *e2b.Provider {
	t.Helper()
	p, err := e2b.New(e2b.Options{
		APIKey: goldenKey, BaseURL: s.srv.URL, EnvdURL: s.srv.URL,
		Now: func() time.Time { return goldenNow }, ReapInterval: -1, Retries: -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// field reads a string member of a golden body, by JSON path segments.
func field(t *testing.T, g *golden.Set, name string, path ...any) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(g.Bytes(t, name), &v); err != nil {
		t.Fatal(err)
	}
	for _, p := range path {
		switch p := p.(type) {
		case string:
			v = v.(map[string]any)[p]
		case int:
			v = v.([]any)[p]
		}
	}
	s, ok := v.(string)
	if !ok {
		t.Fatalf("golden %s %v is %v, not a string", name, path, v)
	}
	return s
}

func mustTime(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// checkAPI checks the headers every REST request carries.
func checkAPI(t *testing.T, c call, withBody bool) {
	t.Helper()
	if got := c.Header.Get("X-API-Key"); got != goldenKey {
		t.Errorf("%s %s: X-API-Key %q (securitySchemes.ApiKeyAuth)", c.Method, c.Path, got)
	}
	if ct := c.Header.Get("Content-Type"); withBody && ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", c.Method, c.Path, ct)
	}
	if !withBody && len(c.Body) > 0 {
		t.Errorf("%s %s: a body %q where none belongs", c.Method, c.Path, c.Body)
	}
}

// checkEnvd checks the routing and authentication headers of an envd
// request.
func checkEnvd(t *testing.T, c call, sandboxID, token string) {
	t.Helper()
	if got := c.Header.Get("E2b-Sandbox-Id"); got != sandboxID {
		t.Errorf("%s %s: E2b-Sandbox-Id %q, want %q", c.Method, c.Path, got, sandboxID)
	}
	if got := c.Header.Get("E2b-Sandbox-Port"); got != "49983" {
		t.Errorf("%s %s: E2b-Sandbox-Port %q", c.Method, c.Path, got)
	}
	if got := c.Header.Get("X-Access-Token"); got != token {
		t.Errorf("%s %s: X-Access-Token %q, want the golden envdAccessToken %q", c.Method, c.Path, got, token)
	}
	if got := c.Header.Get("Authorization"); got != "Basic "+base64.StdEncoding.EncodeToString([]byte("root:")) {
		t.Errorf("%s %s: Authorization %q, want the user root", c.Method, c.Path, got)
	}
}

func TestGoldenCreate(t *testing.T) {
	s := newStub(t)
	s.api.HandleFunc("POST /sandboxes", s.reply(http.StatusCreated, "sandboxes.create.response.json"))
	s.envd.HandleFunc("POST /process.Process/Start", s.stream("process.start.ok.stream.json", "process.end.json", -1, nil))
	p := s.provider(t)
	info, err := p.Create(ctx, sandbox.Spec{Image: "base", Labels: map[string]string{"team": "rl"}, Env: map[string]string{"LANG": "C.UTF-8"}, Expiry: goldenNow.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", "/sandboxes")
	checkAPI(t, c, true)
	s.g.Request(t, "create", "sandboxes.create.request.json", c.Body, nil)

	const resp = "sandboxes.create.response.json"
	id, token := field(t, s.g, resp, "sandboxID"), field(t, s.g, resp, "envdAccessToken")
	if info.ID != id || info.State != sandbox.StateRunning || !info.Expiry.Equal(goldenNow.Add(time.Hour)) || !info.Created.Equal(goldenNow) || info.Labels["team"] != "rl" || len(info.Labels) != 1 {
		t.Errorf("info from golden %s: %+v", resp, info)
	}
	var desc map[string]string
	if err := json.Unmarshal(info.Descriptor, &desc); err != nil || desc["template"] != field(t, s.g, resp, "templateID") || desc["domain"] != field(t, s.g, resp, "domain") {
		t.Errorf("descriptor %s: want the golden templateID and domain", info.Descriptor)
	}
	start := s.one("POST", "/process.Process/Start")
	checkEnvd(t, start, id, token)
	if ct := start.Header.Get("Content-Type"); ct != "application/connect+json" {
		t.Errorf("Start: Content-Type %q", ct)
	}
	s.g.Request(t, "start", "process.start.request.json", unenvelope(t, start.Body), nil)
}

func TestGoldenGetAndList(t *testing.T) {
	s := newStub(t)
	s.api.HandleFunc("GET /sandboxes/{id}", s.reply(http.StatusOK, "sandboxes.get.response.json"))
	s.api.HandleFunc("GET /v2/sandboxes", s.reply(http.StatusOK, "sandboxes.list.response.json"))
	s.envd.HandleFunc("GET /files", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("hi")) })
	p := s.provider(t)

	const get = "sandboxes.get.response.json"
	id := field(t, s.g, get, "sandboxID")
	info, err := p.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("GET", "/sandboxes/"+id), false)
	// The golden sandbox's expiry moved after it was made: endAt, not the
	// stasis.expiry metadata, is its expiry.
	if info.ID != id || info.State != sandbox.StateRunning || !info.Created.Equal(mustTime(t, field(t, s.g, get, "startedAt"))) ||
		!info.Expiry.Equal(mustTime(t, field(t, s.g, get, "endAt"))) || info.Labels["team"] != "rl" || len(info.Labels) != 1 || info.Source != "" {
		t.Errorf("info from golden %s: %+v", get, info)
	}
	var desc map[string]string
	if err := json.Unmarshal(info.Descriptor, &desc); err != nil || desc["template"] != field(t, s.g, get, "templateID") || desc["domain"] != field(t, s.g, get, "domain") {
		t.Errorf("descriptor %s", info.Descriptor)
	}
	// The detail's token reaches envd.
	if _, err := p.ReadFile(ctx, id, "/etc/hostname"); err != nil {
		t.Fatal(err)
	}
	checkEnvd(t, s.one("GET", "/files"), id, field(t, s.g, get, "envdAccessToken"))

	const list = "sandboxes.list.response.json"
	infos, err := p.List(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := s.one("GET", "/v2/sandboxes")
	checkAPI(t, c, false)
	if q := c.Query; q.Get("metadata") != "stasis.provider=e2b" || q.Get("state") != "running,paused" || q.Get("limit") != "100" || len(q) != 3 {
		t.Errorf("list query %v: metadata, state (form, not exploded) and limit", q)
	}
	if len(infos) != 2 {
		t.Fatalf("listed %+v", infos)
	}
	paused, running := infos[0], infos[1] // by creation
	if paused.ID != field(t, s.g, list, 1, "sandboxID") || paused.State != e2b.StatePaused || !paused.Expiry.Equal(mustTime(t, field(t, s.g, list, 1, "metadata", "stasis.expiry"))) ||
		!paused.Created.Equal(mustTime(t, field(t, s.g, list, 1, "startedAt"))) || paused.Labels["team"] != "rl" || len(paused.Labels) != 1 {
		t.Errorf("the paused sandbox of golden %s: %+v", list, paused)
	}
	if running.ID != field(t, s.g, list, 0, "sandboxID") || running.State != sandbox.StateRunning || !running.Expiry.Equal(mustTime(t, field(t, s.g, list, 0, "endAt"))) ||
		running.Source != field(t, s.g, list, 0, "metadata", "stasis.source") || running.Labels["k"] != "v" || len(running.Labels) != 1 {
		t.Errorf("the running sandbox of golden %s: %+v", list, running)
	}
}

func TestGoldenSetExpiryPauseResume(t *testing.T) {
	s := newStub(t)
	const get, connected = "sandboxes.get.response.json", "sandboxes.connect.response.json"
	id := field(t, s.g, get, "sandboxID")
	s.api.HandleFunc("GET /sandboxes/{id}", s.reply(http.StatusOK, get))
	s.api.HandleFunc("POST /sandboxes/{id}/timeout", s.reply(http.StatusNoContent, ""))
	s.api.HandleFunc("POST /sandboxes/{id}/pause", s.reply(http.StatusNoContent, ""))
	s.api.HandleFunc("POST /sandboxes/{id}/connect", s.reply(http.StatusCreated, connected))
	s.envd.HandleFunc("GET /files", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("hi")) })
	p := s.provider(t)
	if _, err := p.Get(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := p.SetExpiry(ctx, id, goldenNow.Add(2*time.Hour)); err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", "/sandboxes/"+id+"/timeout")
	checkAPI(t, c, true)
	s.g.Request(t, "set-expiry", "sandboxes.timeout.request.json", c.Body, nil)

	if err := p.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	c = s.one("POST", "/sandboxes/"+id+"/pause")
	checkAPI(t, c, true)
	s.g.Request(t, "pause", "sandboxes.pause.request.json", c.Body, nil)

	info, err := p.Resume(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	c = s.one("POST", "/sandboxes/"+id+"/connect")
	checkAPI(t, c, true)
	s.g.Request(t, "resume", "sandboxes.connect.request.json", c.Body, nil)
	if info.ID != id || info.State != sandbox.StateRunning || !info.Expiry.Equal(goldenNow.Add(2*time.Hour)) {
		t.Errorf("resumed: %+v", info)
	}
	if n := len(s.calls("POST", "/sandboxes/"+id+"/timeout")); n != 1 {
		t.Errorf("%d timeouts: a 201 from connect (resumed) needs no second one", n)
	}
	// The resumed sandbox's new token reaches envd.
	if _, err := p.ReadFile(ctx, id, "/etc/hostname"); err != nil {
		t.Fatal(err)
	}
	checkEnvd(t, s.one("GET", "/files"), id, field(t, s.g, connected, "envdAccessToken"))
}

func TestGoldenSnapshotForkDelete(t *testing.T) {
	s := newStub(t)
	const get, snapped, listed, created = "sandboxes.get.response.json", "sandboxes.snapshots.response.json", "snapshots.list.response.json", "sandboxes.create.response.json"
	id, snapID := field(t, s.g, get, "sandboxID"), field(t, s.g, snapped, "snapshotID")
	s.api.HandleFunc("GET /sandboxes/{id}", s.reply(http.StatusOK, get))
	s.api.HandleFunc("POST /sandboxes/{id}/snapshots", s.reply(http.StatusCreated, snapped))
	s.api.HandleFunc("GET /snapshots", s.reply(http.StatusOK, listed))
	s.api.HandleFunc("POST /sandboxes", s.reply(http.StatusCreated, created))
	s.api.HandleFunc("DELETE /templates/{id}", s.reply(http.StatusNoContent, ""))
	s.api.HandleFunc("DELETE /sandboxes/{id}", s.reply(http.StatusNoContent, ""))
	p := s.provider(t)

	snap, err := p.Snapshot(ctx, id, "")
	if err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", "/sandboxes/"+id+"/snapshots")
	checkAPI(t, c, true)
	s.g.Request(t, "snapshot", "sandboxes.snapshots.request.json", c.Body, nil)
	if snap.ID != snapID || snap.Sandbox != id {
		t.Errorf("snapshot from golden %s: %+v", snapped, snap)
	}

	// Another process finds it by id, and a named one by a name.
	other := s.provider(t)
	for _, want := range []string{snapID, field(t, s.g, listed, 0, "names", 1)} {
		got, err := other.GetSnapshot(ctx, want)
		if err != nil || got.ID != want {
			t.Errorf("get-snapshot %s from golden %s: %+v %v", want, listed, got, err)
		}
	}
	if _, err := other.GetSnapshot(ctx, "nosuch:default"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("get-snapshot of one not listed: %v", err)
	}
	for _, c := range s.calls("GET", "/snapshots") {
		checkAPI(t, c, false)
		if c.Query.Get("name") == "" || c.Query.Get("limit") != "100" {
			t.Errorf("snapshots query %v", c.Query)
		}
	}

	forks, err := p.Fork(ctx, snapID, 1, sandbox.ForkSpec{Labels: map[string]string{"k": "v"}, Expiry: goldenNow.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	c = s.one("POST", "/sandboxes")
	checkAPI(t, c, true)
	s.g.Request(t, "fork", "sandboxes.fork.request.json", c.Body, nil)
	if forks[0].ID != field(t, s.g, created, "sandboxID") || forks[0].Source != snapID || forks[0].Labels["k"] != "v" {
		t.Errorf("fork from golden %s: %+v", created, forks[0])
	}

	if err := p.DeleteSnapshot(ctx, snapID); err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("DELETE", "/templates/"+snapID), false)
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("DELETE", "/sandboxes/"+id), false)
}

func TestGoldenErrors(t *testing.T) {
	s := newStub(t)
	s.api.HandleFunc("GET /sandboxes/{id}", s.reply(http.StatusNotFound, "error.notfound.response.json"))
	s.api.HandleFunc("POST /sandboxes", s.reply(http.StatusServiceUnavailable, "error.capacity.response.json"))
	p := s.provider(t)
	_, err := p.Get(ctx, "nosuchsandbox0000000")
	if msg := field(t, s.g, "error.notfound.response.json", "message"); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), msg) {
		t.Errorf("get answered 404: %v, want ErrNotFound with the message %q", err, msg)
	}
	_, err = p.Create(ctx, sandbox.Spec{Expiry: goldenNow.Add(time.Hour)})
	var ae *e2b.APIError
	const capacity = "error.capacity.response.json"
	if !errors.As(err, &ae) || ae.Status != http.StatusServiceUnavailable || !strings.Contains(ae.Message, field(t, s.g, capacity, "message")) || !strings.Contains(ae.Message, field(t, s.g, capacity, "error_code")) {
		t.Errorf("create answered 503: %#v, want an APIError with the message and the error_code", err)
	}
}

func TestGoldenFiles(t *testing.T) {
	s := newStub(t)
	const get, uploaded, missing = "sandboxes.get.response.json", "files.upload.response.json", "files.notfound.response.json"
	id, token := field(t, s.g, get, "sandboxID"), field(t, s.g, get, "envdAccessToken")
	path := field(t, s.g, uploaded, 0, "path")
	s.api.HandleFunc("GET /sandboxes/{id}", s.reply(http.StatusOK, get))
	s.envd.HandleFunc("POST /files", s.reply(http.StatusOK, uploaded))
	s.envd.HandleFunc("POST /process.Process/Start", s.stream("process.start.ok.stream.json", "process.end.json", -1, nil))
	notFound := s.reply(http.StatusNotFound, missing)
	s.envd.HandleFunc("GET /files", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("path") != path {
			notFound(w, r)
			return
		}
		_, _ = w.Write([]byte("hello"))
	})
	p := s.provider(t)
	if err := p.WriteFile(ctx, id, path, []byte("hello"), 0o640); err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", "/files")
	checkEnvd(t, c, id, token)
	if q := c.Query; q.Get("path") != path || q.Get("username") != "root" || c.Header.Get("Content-Type") != "application/octet-stream" || string(c.Body) != "hello" {
		t.Errorf("upload: query %v, Content-Type %q, body %q: a raw body, path and username (envd.yaml FilePath, User)", q, c.Header.Get("Content-Type"), c.Body)
	}
	b, err := p.ReadFile(ctx, id, path)
	if err != nil || string(b) != "hello" {
		t.Fatalf("read: %q %v", b, err)
	}
	_, err = p.ReadFile(ctx, id, "/home/user/missing.txt")
	if msg := field(t, s.g, missing, "message"); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), msg) {
		t.Errorf("read of a missing file: %v, want ErrNotFound with the message %q", err, msg)
	}
	for _, c := range s.calls("GET", "/files") {
		checkEnvd(t, c, id, token)
		if c.Query.Get("username") != "root" {
			t.Errorf("download query %v", c.Query)
		}
	}
}

func TestGoldenExec(t *testing.T) {
	const get = "sandboxes.get.response.json"
	setup := func(t *testing.T) (*stub, *e2b.Provider, string) {
		s := newStub(t)
		s.api.HandleFunc("GET /sandboxes/{id}", s.reply(http.StatusOK, get))
		return s, s.provider(t), field(t, s.g, get, "sandboxID")
	}
	unary := func(t *testing.T, s *stub, c call, golden string) {
		t.Helper()
		checkEnvd(t, c, field(t, s.g, get, "sandboxID"), field(t, s.g, get, "envdAccessToken"))
		if c.Header.Get("Content-Type") != "application/json" || c.Header.Get("Connect-Protocol-Version") != "1" {
			t.Errorf("%s: Content-Type %q, Connect-Protocol-Version %q: a unary Connect call", c.Path, c.Header.Get("Content-Type"), c.Header.Get("Connect-Protocol-Version"))
		}
		s.g.Request(t, c.Path, golden, c.Body, nil)
	}

	t.Run("stdin", func(t *testing.T) {
		s, p, id := setup(t)
		closed := make(chan struct{})
		var once sync.Once
		s.envd.HandleFunc("POST /process.Process/Start", s.stream("process.start.stdin.stream.json", "process.end.json", 4, closed))
		s.envd.HandleFunc("POST /process.Process/SendInput", s.reply(http.StatusOK, "process.unary.response.json"))
		s.envd.HandleFunc("POST /process.Process/CloseStdin", func(w http.ResponseWriter, r *http.Request) {
			once.Do(func() { close(closed) })
			s.reply(http.StatusOK, "process.unary.response.json")(w, r)
		})
		var out, errb bytes.Buffer
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", "cat; echo warn >&2; exit 7"}, Env: map[string]string{"A": "1"}, Cwd: "sub", Stdin: strings.NewReader("input"), Stdout: &out, Stderr: &errb})
		if err != nil || res.ExitCode != 7 || out.String() != "input" || errb.String() != "warn\n" {
			t.Fatalf("exec with the golden stream: %+v %v, stdout %q, stderr %q", res, err, out.String(), errb.String())
		}
		start := s.one("POST", "/process.Process/Start")
		s.g.Request(t, "start", "process.start.stdin.request.json", unenvelope(t, start.Body), nil)
		unary(t, s, s.one("POST", "/process.Process/SendInput"), "process.sendinput.request.json")
		unary(t, s, s.one("POST", "/process.Process/CloseStdin"), "process.closestdin.request.json")
	})

	t.Run("timeout", func(t *testing.T) {
		s, p, id := setup(t)
		never := make(chan struct{})
		s.envd.HandleFunc("POST /process.Process/Start", s.stream("process.start.killed.stream.json", "process.end.json", 1, never))
		s.envd.HandleFunc("POST /process.Process/SendSignal", s.reply(http.StatusOK, "process.unary.response.json"))
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sleep", "60"}, Timeout: 50 * time.Millisecond})
		if !errors.Is(err, errdefs.ErrTimeout) || res.ExitCode != -9 {
			t.Fatalf("exec past its timeout: %+v %v", res, err)
		}
		start := s.one("POST", "/process.Process/Start")
		if got := start.Header.Get("Connect-Timeout-Ms"); got != "50" {
			t.Errorf("Connect-Timeout-Ms %q", got)
		}
		s.g.Request(t, "start", "process.start.sleep.request.json", unenvelope(t, start.Body), nil)
		unary(t, s, s.one("POST", "/process.Process/SendSignal"), "process.sendsignal.request.json")
	})

	t.Run("killed", func(t *testing.T) {
		s, p, id := setup(t)
		s.envd.HandleFunc("POST /process.Process/Start", s.stream("process.start.killed.stream.json", "process.end.json", -1, nil))
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sleep", "60"}})
		if err != nil || res.ExitCode != -9 {
			t.Fatalf("a process a signal ended: %+v %v, want exit -9 from the golden status %q", res, err, "signal: killed")
		}
	})

	t.Run("end-stream error", func(t *testing.T) {
		s, p, id := setup(t)
		s.envd.HandleFunc("POST /process.Process/Start", s.stream("", "process.end.error.json", -1, nil))
		_, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"nosuchcmd"}})
		if msg := field(t, s.g, "process.end.error.json", "error", "message"); !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), msg) {
			t.Fatalf("a stream ended by an invalid_argument error: %v, want ErrInvalid with %q", err, msg)
		}
	})

	t.Run("unary error", func(t *testing.T) {
		// SendInput to a process that has ended: not_found, which is
		// no error of the call.
		s, p, id := setup(t)
		sent := make(chan struct{})
		var once sync.Once
		s.envd.HandleFunc("POST /process.Process/Start", s.stream("process.start.stdin.stream.json", "process.end.json", 4, sent))
		notFound := s.reply(http.StatusNotFound, "process.unary.error.json")
		s.envd.HandleFunc("POST /process.Process/SendInput", func(w http.ResponseWriter, r *http.Request) {
			notFound(w, r)
			once.Do(func() { close(sent) })
		})
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", "cat; echo warn >&2; exit 7"}, Stdin: strings.NewReader("input")})
		if err != nil || res.ExitCode != 7 {
			t.Fatalf("exec whose SendInput found the process gone: %+v %v", res, err)
		}
		if n := len(s.calls("POST", "/process.Process/CloseStdin")); n != 0 {
			t.Errorf("%d CloseStdin after not_found", n)
		}
	})
}
