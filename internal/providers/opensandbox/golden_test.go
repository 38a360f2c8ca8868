package opensandbox_test

// The client held to the golden bodies of testdata/golden (written from
// OpenSandbox's specifications, see its README): a plain httptest server,
// not the fake, answers with the golden responses and records what the
// provider sends, which must match the golden requests. The fake is held
// to the same files in internal/providers/opensandbox/osfake.

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/golden"
	"stasis/internal/providers/opensandbox"
	"stasis/sandbox"
)

// goldenNow is the provider's clock in these tests: the timeouts and
// expiries of the golden requests are computed from it.
var goldenNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

const goldenKey = "osk-0123456789abcdef"

// specHost is the endpoint host of the golden Endpoint, which the stub
// answers with its own.
const specHost = "endpoint.opensandbox.io"

type call struct {
	Method, Path string
	Query        url.Values
	Header       http.Header
	Body         []byte
}

// stub is the plain server: the Lifecycle API under /v1 and execd at the
// endpoint the golden Endpoint names, each route a handler of the test.
type stub struct {
	t   *testing.T
	g   *golden.Set
	mux *http.ServeMux
	srv *httptest.Server

	mu  sync.Mutex
	log []call
}

func newStub(t *testing.T) *stub {
	t.Helper()
	s := &stub{t: t, g: golden.MustLoad(t, "testdata/golden"), mux: http.NewServeMux()}
	s.srv = httptest.NewServer(s)
	t.Cleanup(s.srv.Close)
	return s
}

func (s *stub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(b))
	s.mu.Lock()
	s.log = append(s.log, call{Method: r.Method, Path: r.URL.Path, Query: r.URL.Query(), Header: r.Header.Clone(), Body: b})
	s.mu.Unlock()
	if _, pattern := s.mux.Handler(r); pattern == "" {
		s.t.Errorf("the provider called %s %s, which this test does not expect", r.Method, r.URL.Path)
		http.Error(w, "unexpected", http.StatusTeapot)
		return
	}
	s.mux.ServeHTTP(w, r)
}

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

// execd serves the golden Endpoint (its host the stub's) and execd's ping
// behind it.
func (s *stub) execd() {
	ep := s.g.Bytes(s.t, "sandboxes.endpoint.response.json")
	s.mux.HandleFunc("GET /v1/sandboxes/{id}/endpoints/{port}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(bytes.ReplaceAll(ep, []byte(specHost), []byte(r.Host)))
	})
	s.mux.HandleFunc("GET /sandboxes/{id}/port/{port}/ping", s.reply(http.StatusOK, ""))
}

var markRE = regexp.MustCompile(`__stasis_end_[0-9a-f]+`)

// events answers POST /command with the golden event stream: its events
// up to its last, then the wrapper's end marker with the exit code rc as
// execd would send the wrapper's output (rc < 0: no marker, as when the
// wrapper did not finish), then the last golden event. bare writes each
// event as execd does (a JSON line, a blank line), else as the standard
// text/event-stream framing ("data:" lines) the specification names.
func (s *stub) events(name string, rc int, bare bool) http.HandlerFunc {
	var evs []map[string]any
	if err := json.Unmarshal(s.g.Bytes(s.t, name), &evs); err != nil {
		s.t.Fatal(err)
	}
	return func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Command string `json:"command"`
		}
		_ = json.Unmarshal(mustRead(r), &req)
		mark := markRE.FindString(req.Command)
		w.Header().Set("Content-Type", "text/event-stream")
		write := func(ev map[string]any) {
			b, _ := json.Marshal(ev)
			if bare {
				_, _ = w.Write(append(b, '\n', '\n'))
			} else {
				_, _ = w.Write([]byte("data: " + string(b) + "\n\n"))
			}
		}
		for _, ev := range evs[:len(evs)-1] {
			write(ev)
		}
		if rc >= 0 && mark != "" {
			line := func(typ, text string) map[string]any {
				return map[string]any{"type": typ, "text": text, "timestamp": 1893553448100}
			}
			write(line("stdout", "\n"))
			write(line("stdout", mark+" "+itoa(rc)))
			write(line("stderr", "\n"))
			write(line("stderr", mark))
		}
		write(evs[len(evs)-1])
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func mustRead(r *http.Request) []byte {
	b, _ := io.ReadAll(r.Body)
	return b
}

func (s *stub) provider(t *testing.T) *opensandbox.Provider {
	t.Helper()
	p, err := opensandbox.New(opensandbox.Options{
		URL: s.srv.URL, APIKey: goldenKey, Resources: map[string]string{"cpu": "500m", "memory": "512Mi"},
		Now: func() time.Time { return goldenNow }, PollInterval: time.Millisecond, RetryBase: time.Millisecond, MaxAttempts: 1,
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

func checkAPI(t *testing.T, c call, withBody bool) {
	t.Helper()
	if got := c.Header.Get("OPEN-SANDBOX-API-KEY"); got != goldenKey {
		t.Errorf("%s %s: OPEN-SANDBOX-API-KEY %q (securitySchemes.apiKeyAuth)", c.Method, c.Path, got)
	}
	if ct := c.Header.Get("Content-Type"); withBody && ct != "application/json" {
		t.Errorf("%s %s: Content-Type %q", c.Method, c.Path, ct)
	}
	if !withBody && len(c.Body) > 0 {
		t.Errorf("%s %s: a body %q where none belongs", c.Method, c.Path, c.Body)
	}
}

func checkExecd(t *testing.T, s *stub, c call) {
	t.Helper()
	token := field(t, s.g, "sandboxes.endpoint.response.json", "headers", "X-EXECD-ACCESS-TOKEN")
	if got := c.Header.Get("X-EXECD-ACCESS-TOKEN"); got != token {
		t.Errorf("%s %s: X-EXECD-ACCESS-TOKEN %q, want the golden Endpoint's header %q", c.Method, c.Path, got, token)
	}
	if got := c.Header.Get("OPEN-SANDBOX-API-KEY"); got != "" {
		t.Errorf("%s %s: the API key goes to execd", c.Method, c.Path)
	}
}

// commandVolatile: the command is the provider's wrapper, checked apart.
var commandVolatile = map[string]string{"/command": golden.AnyString}

func commandOf(t *testing.T, c call) string {
	t.Helper()
	var req struct {
		Command string `json:"command"`
	}
	if err := json.Unmarshal(c.Body, &req); err != nil {
		t.Fatal(err)
	}
	return req.Command
}

const (
	getGolden = "sandboxes.get.response.json"
	sbPath    = "/v1/sandboxes/0b6f2c1e-4a7d-4e3b-9f51-8c2d7a6e5b41"
	execdPath = "/sandboxes/0b6f2c1e-4a7d-4e3b-9f51-8c2d7a6e5b41/port/44772"
)

func TestGoldenCreate(t *testing.T) {
	s := newStub(t)
	s.mux.HandleFunc("POST /v1/sandboxes", s.reply(http.StatusAccepted, "sandboxes.create.response.json"))
	s.mux.HandleFunc("GET /v1/sandboxes/{id}", s.reply(http.StatusOK, getGolden))
	s.execd()
	s.mux.HandleFunc("POST /sandboxes/{id}/port/{port}/command", s.events("command.events.json", 0, false))
	p := s.provider(t)
	info, err := p.Create(ctx, sandbox.Spec{Image: "python:3.11", Env: map[string]string{"PYTHONUNBUFFERED": "1"}, Labels: map[string]string{"team": "ml"}, Expiry: goldenNow.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", "/v1/sandboxes")
	checkAPI(t, c, true)
	s.g.Request(t, "create", "sandboxes.create.request.json", c.Body, nil)
	if id := field(t, s.g, "sandboxes.create.response.json", "id"); info.ID != id || info.State != sandbox.StateRunning || info.Labels["team"] != "ml" || len(info.Labels) != 1 ||
		!info.Expiry.Equal(goldenNow.Add(time.Hour)) || !info.Created.Equal(mustTime(t, field(t, s.g, getGolden, "createdAt"))) {
		t.Errorf("info: %+v", info)
	}
	checkAPI(t, s.one("GET", sbPath+"/endpoints/44772"), false)
	if q := s.one("GET", sbPath+"/endpoints/44772").Query; len(q) != 0 {
		t.Errorf("endpoint query %v", q)
	}
	checkExecd(t, s, s.one("GET", execdPath+"/ping"))
	cmd := s.one("POST", execdPath+"/command")
	checkExecd(t, s, cmd)
	if cmd.Header.Get("Content-Type") != "application/json" || cmd.Header.Get("Accept") != "text/event-stream" {
		t.Errorf("command: Content-Type %q, Accept %q", cmd.Header.Get("Content-Type"), cmd.Header.Get("Accept"))
	}
	s.g.Request(t, "mkdir", "command.mkdir.request.json", cmd.Body, commandVolatile)
	if got := commandOf(t, cmd); !strings.Contains(got, `'mkdir' '-p' '--' '/work'`) {
		t.Errorf("the wrapper runs %q", got)
	}
}

func TestGoldenGetListExpiry(t *testing.T) {
	s := newStub(t)
	s.mux.HandleFunc("GET /v1/sandboxes/{id}", s.reply(http.StatusOK, getGolden))
	s.mux.HandleFunc("GET /v1/sandboxes", s.reply(http.StatusOK, "sandboxes.list.response.json"))
	s.mux.HandleFunc("POST /v1/sandboxes/{id}/renew-expiration", s.reply(http.StatusOK, "sandboxes.renew.response.json"))
	s.mux.HandleFunc("PATCH /v1/sandboxes/{id}/metadata", s.reply(http.StatusOK, getGolden))
	p := s.provider(t)
	id := field(t, s.g, getGolden, "id")
	info, err := p.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("GET", sbPath), false)
	if info.ID != id || info.State != sandbox.StateRunning || info.Labels["team"] != "ml" || len(info.Labels) != 1 || info.Source != "" ||
		!info.Expiry.Equal(goldenNow.Add(time.Hour)) || !info.Created.Equal(mustTime(t, field(t, s.g, getGolden, "createdAt"))) {
		t.Errorf("info from golden %s: %+v", getGolden, info)
	}

	const list = "sandboxes.list.response.json"
	infos, err := p.List(ctx, map[string]string{"project": "data-processing"})
	if err != nil {
		t.Fatal(err)
	}
	c := s.one("GET", "/v1/sandboxes")
	checkAPI(t, c, false)
	if q := c.Query; q.Get("page") != "1" || q.Get("pageSize") != "100" || q.Get("metadata") != "project=data-processing" || len(q) != 3 {
		t.Errorf("list query %v: page, pageSize, metadata as a query string", q)
	}
	// The server filtered already (the golden answer is a filter's); the
	// provider keeps what matches the labels.
	if len(infos) != 1 || infos[0].ID != field(t, s.g, list, "items", 0, "id") || infos[0].Source != field(t, s.g, list, "items", 0, "snapshotId") ||
		infos[0].State != sandbox.StateRunning || !infos[0].Expiry.Equal(goldenNow.Add(time.Hour)) || !infos[0].Created.Equal(mustTime(t, field(t, s.g, list, "items", 0, "createdAt"))) {
		t.Errorf("listed from golden %s: %+v", list, infos)
	}
	all, err := p.List(ctx, nil)
	if err != nil || len(all) != 2 || all[0].ID != field(t, s.g, list, "items", 1, "id") || all[0].State != "paused" || !all[0].Expiry.Equal(goldenNow.Add(3*time.Hour)) {
		t.Errorf("all listed from golden %s: %+v %v", list, all, err)
	}

	if err := p.SetExpiry(ctx, id, goldenNow.Add(2*time.Hour)); err != nil {
		t.Fatal(err)
	}
	c = s.one("POST", sbPath+"/renew-expiration")
	checkAPI(t, c, true)
	s.g.Request(t, "renew", "sandboxes.renew.request.json", c.Body, nil)
	c = s.one("PATCH", sbPath+"/metadata")
	checkAPI(t, c, true)
	s.g.Request(t, "metadata", "sandboxes.metadata.request.json", c.Body, nil)
	// The renewed server expiry is the golden answer's: a later SetExpiry
	// within it renews nothing.
	if err := p.SetExpiry(ctx, id, goldenNow.Add(2*time.Hour-time.Minute)); err != nil {
		t.Fatal(err)
	}
	if n := len(s.calls("POST", sbPath+"/renew-expiration")); n != 1 {
		t.Errorf("%d renewals: the golden answer's expiresAt was not read", n)
	}
}

func TestGoldenPauseResume(t *testing.T) {
	s := newStub(t)
	var mu sync.Mutex
	state := getGolden
	s.mux.HandleFunc("GET /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		name := state
		mu.Unlock()
		s.reply(http.StatusOK, name)(w, r)
	})
	to := func(name string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			state = name
			mu.Unlock()
			w.WriteHeader(http.StatusAccepted)
		}
	}
	s.mux.HandleFunc("POST /v1/sandboxes/{id}/pause", to("sandboxes.get.paused.response.json"))
	s.mux.HandleFunc("POST /v1/sandboxes/{id}/resume", to(getGolden))
	s.execd()
	p := s.provider(t)
	id := field(t, s.g, getGolden, "id")
	if err := p.Pause(ctx, id); err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("POST", sbPath+"/pause"), false)
	if info, err := p.Get(ctx, id); err != nil || info.State != "paused" {
		t.Errorf("after pause, from golden sandboxes.get.paused.response.json: %+v %v", info, err)
	}
	if err := p.Resume(ctx, id); err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("POST", sbPath+"/resume"), false)
	checkExecd(t, s, s.one("GET", execdPath+"/ping"))
}

func TestGoldenSnapshotForkDelete(t *testing.T) {
	s := newStub(t)
	s.mux.HandleFunc("GET /v1/sandboxes/{id}", s.reply(http.StatusOK, getGolden))
	s.mux.HandleFunc("POST /v1/sandboxes/{id}/snapshots", s.reply(http.StatusAccepted, "sandboxes.snapshots.response.json"))
	s.mux.HandleFunc("GET /v1/snapshots/{sid}", s.reply(http.StatusOK, "snapshots.get.response.json"))
	s.mux.HandleFunc("POST /v1/sandboxes", s.reply(http.StatusAccepted, "sandboxes.create.response.json"))
	s.mux.HandleFunc("DELETE /v1/snapshots/{sid}", s.reply(http.StatusNoContent, ""))
	s.mux.HandleFunc("DELETE /v1/sandboxes/{id}", s.reply(http.StatusNoContent, ""))
	s.execd()
	p := s.provider(t)
	id := field(t, s.g, getGolden, "id")
	const ready = "snapshots.get.response.json"
	snapID := field(t, s.g, ready, "id")

	snap, err := p.Snapshot(ctx, id, "checkpoint-before-import")
	if err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", sbPath+"/snapshots")
	checkAPI(t, c, true)
	s.g.Request(t, "snapshot", "sandboxes.snapshots.request.json", c.Body, nil)
	if snap.ID != snapID || snap.Name != field(t, s.g, ready, "name") || snap.Sandbox != field(t, s.g, ready, "sandboxId") || !snap.Created.Equal(mustTime(t, field(t, s.g, ready, "createdAt"))) {
		t.Errorf("snapshot from golden %s: %+v", ready, snap)
	}
	checkAPI(t, s.one("GET", "/v1/snapshots/"+snapID), false)
	if _, err := p.Snapshot(ctx, id, ""); err != nil {
		t.Fatal(err)
	}
	s.g.Request(t, "unnamed snapshot", "sandboxes.snapshots.unnamed.request.json", s.calls("POST", sbPath+"/snapshots")[1].Body, nil)

	forks, err := p.Fork(ctx, snapID, 1, sandbox.ForkSpec{Labels: map[string]string{"project": "data-processing"}, Expiry: goldenNow.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	c = s.one("POST", "/v1/sandboxes")
	checkAPI(t, c, true)
	s.g.Request(t, "fork", "sandboxes.fork.request.json", c.Body, nil)
	if forks[0].ID != id {
		t.Errorf("fork: %+v", forks[0])
	}

	if err := p.DeleteSnapshot(ctx, snapID); err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("DELETE", "/v1/snapshots/"+snapID), false)
	if err := p.Delete(ctx, id); err != nil {
		t.Fatal(err)
	}
	checkAPI(t, s.one("DELETE", sbPath), false)
}

func TestGoldenErrors(t *testing.T) {
	s := newStub(t)
	const bad = "error.response.json"
	s.mux.HandleFunc("GET /v1/sandboxes/{id}", s.reply(http.StatusNotFound, bad))
	s.mux.HandleFunc("DELETE /v1/snapshots/{sid}", s.reply(http.StatusForbidden, bad))
	p := s.provider(t)
	if _, err := p.Get(ctx, "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("get answered 404: %v", err)
	}
	err := p.DeleteSnapshot(ctx, "snap_123")
	if !errors.Is(err, opensandbox.ErrUnauthorized) || !strings.Contains(err.Error(), field(t, s.g, bad, "code")) || !strings.Contains(err.Error(), field(t, s.g, bad, "message")) {
		t.Errorf("delete answered 403: %v, want ErrUnauthorized with the golden code and message", err)
	}
}

func TestGoldenExec(t *testing.T) {
	setup := func(t *testing.T) (*stub, *opensandbox.Provider, string) {
		s := newStub(t)
		s.mux.HandleFunc("GET /v1/sandboxes/{id}", s.reply(http.StatusOK, getGolden))
		s.execd()
		return s, s.provider(t), field(t, s.g, getGolden, "id")
	}
	for _, bare := range []bool{false, true} {
		name := "event-stream framing"
		if bare {
			name = "execd's framing"
		}
		t.Run(name, func(t *testing.T) {
			s, p, id := setup(t)
			s.mux.HandleFunc("POST /sandboxes/{id}/port/{port}/command", s.events("command.events.json", 3, bare))
			var out, errb bytes.Buffer
			argv := []string{"sh", "-c", "echo 'Hello, World!'; echo; echo 'warning: disk almost full' >&2; exit 3"}
			res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: argv, Cwd: "/tmp", Env: map[string]string{"PYTHONUNBUFFERED": "1"}, Timeout: 30 * time.Second, Stdout: &out, Stderr: &errb})
			if err != nil || res.ExitCode != 3 || out.String() != "Hello, World!\n\n" || errb.String() != "warning: disk almost full\n" {
				t.Fatalf("exec with the golden events: %+v %v, stdout %q, stderr %q", res, err, out.String(), errb.String())
			}
			cmd := s.one("POST", execdPath+"/command")
			s.g.Request(t, "command", "command.request.json", cmd.Body, commandVolatile)
			if got := commandOf(t, cmd); !strings.Contains(got, `exec 'sh' '-c'`) {
				t.Errorf("the wrapper runs %q", got)
			}
		})
	}

	t.Run("error event", func(t *testing.T) {
		s, p, id := setup(t)
		s.mux.HandleFunc("POST /sandboxes/{id}/port/{port}/command", s.events("command.error.events.json", -1, false))
		_, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"true"}})
		const evs = "command.error.events.json"
		if err == nil || !strings.Contains(err.Error(), field(t, s.g, evs, 1, "error", "ename")) || !strings.Contains(err.Error(), ": "+field(t, s.g, evs, 1, "error", "evalue")) {
			t.Fatalf("a command whose stream ended in the golden error event: %v, want its ename and evalue", err)
		}
	})
}

func TestGoldenFiles(t *testing.T) {
	s := newStub(t)
	s.mux.HandleFunc("GET /v1/sandboxes/{id}", s.reply(http.StatusOK, getGolden))
	s.execd()
	const meta = "files.upload.metadata.json"
	path := field(t, s.g, meta, "path")
	s.mux.HandleFunc("POST /sandboxes/{id}/port/{port}/files/upload", s.reply(http.StatusOK, ""))
	notFound := s.reply(http.StatusNotFound, "files.notfound.response.json")
	s.mux.HandleFunc("GET /sandboxes/{id}/port/{port}/files/download", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("path") != path {
			notFound(w, r)
			return
		}
		_, _ = w.Write([]byte("hello"))
	})
	p := s.provider(t)
	id := field(t, s.g, getGolden, "id")
	if err := p.WriteFile(ctx, id, path, []byte("hello"), 0o755); err != nil {
		t.Fatal(err)
	}
	c := s.one("POST", execdPath+"/files/upload")
	checkExecd(t, s, c)
	mt, params, err := mime.ParseMediaType(c.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" {
		t.Fatalf("upload Content-Type %q", c.Header.Get("Content-Type"))
	}
	mr := multipart.NewReader(bytes.NewReader(c.Body), params["boundary"])
	var parts []string
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(part)
		parts = append(parts, part.FormName())
		switch part.FormName() {
		case "metadata":
			if ct := part.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("the metadata part's Content-Type %q (the specification's encoding)", ct)
			}
			s.g.Request(t, "upload metadata", meta, b, nil)
		case "file":
			if string(b) != "hello" {
				t.Errorf("the file part %q", b)
			}
		}
	}
	if strings.Join(parts, ",") != "metadata,file" {
		t.Errorf("upload parts %v: a metadata part then the file part", parts)
	}
	b, err := p.ReadFile(ctx, id, path)
	if err != nil || string(b) != "hello" {
		t.Fatalf("read: %q %v", b, err)
	}
	if q := s.calls("GET", execdPath+"/files/download")[0].Query; q.Get("path") != path {
		t.Errorf("download query %v", q)
	}
	if _, err := p.ReadFile(ctx, id, "/workspace/missing.txt"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("read of a missing file, answered the golden FILE_NOT_FOUND: %v", err)
	}

	// Download: tar writes a file, which is downloaded, then removed with
	// DELETE /files?path= (removeFiles: path, exploded).
	s.mux.HandleFunc("POST /sandboxes/{id}/port/{port}/command", s.events("command.events.json", 0, true))
	s.mux.HandleFunc("DELETE /sandboxes/{id}/port/{port}/files", s.reply(http.StatusOK, ""))
	var tarball bytes.Buffer
	if err := p.Download(ctx, id, "/workspace", &tarball); !errors.Is(err, errdefs.ErrNotFound) {
		// The stub has no such file to download: the golden 404.
		t.Errorf("download: %v, want the golden FILE_NOT_FOUND", err)
	}
	dl := s.calls("GET", execdPath+"/files/download")
	rm := s.one("DELETE", execdPath+"/files")
	checkExecd(t, s, rm)
	if got, want := rm.Query["path"], dl[len(dl)-1].Query.Get("path"); len(got) != 1 || got[0] != want || !strings.HasPrefix(want, "/tmp/") {
		t.Errorf("remove query %v, want the downloaded file %q", rm.Query, want)
	}
}
