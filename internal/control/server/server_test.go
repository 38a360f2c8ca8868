package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/coordinator"
	"stasis/internal/control/openapi"
	"stasis/internal/control/relay"
	"stasis/internal/control/server"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/harness"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// binaryEnv makes the test binary act as stasis in the sandboxes, without
// the race detector's one-second sleep at each exit.
var binaryEnv = map[string]string{"STASIS_TEST_AS_CLI": "1", "GORACE": "atexit_sleep_ms=0"}

// view is the part of an episode's view the tests read.
type view struct {
	store.Episode
	Live       bool    `json:"live"`
	Status     *status `json:"status"`
	ModelCalls int64   `json:"model_calls"`
	LedgerOK   bool    `json:"ledger_ok"`
	Reward     *int    `json:"reward"`
	TokenPath  string  `json:"token_path"`
	// StatusError is why the supervisor's status could not be read.
	StatusError string `json:"status_error"`
}

type status struct {
	State   string `json:"state"`
	Receipt *struct {
		ReturnCode       *int `json:"return_code"`
		CleanupConfirmed bool `json:"cleanup_confirmed"`
	} `json:"receipt"`
}

type verifyResponse struct {
	Verdict  task.Verdict `json:"verdict"`
	Recorded bool         `json:"recorded"`
}

type apiErr struct {
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

// client calls a server's API.
type client struct {
	t    *testing.T
	base string
	// header is set on every request.
	header map[string]string
}

// do sends body (a string as it is, anything else as JSON) and returns the
// status and the answer.
func (c *client) do(method, path string, body any) (int, []byte) {
	c.t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	case []byte:
		r = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			c.t.Fatal(err)
		}
		r = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, c.base+path, r)
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range c.header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.StatusCode, out
}

// call expects status want and decodes the answer into out (if not nil).
func (c *client) call(method, path string, body any, want int, out any) {
	c.t.Helper()
	code, b := c.do(method, path, body)
	if code != want {
		c.t.Fatalf("%s %s: %d, want %d: %s", method, path, code, want, b)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			c.t.Fatalf("%s %s: %v: %s", method, path, err, b)
		}
	}
}

// refuse expects an error answer with status want and type typ.
func (c *client) refuse(method, path string, body any, want int, typ, says string) {
	c.t.Helper()
	code, b := c.do(method, path, body)
	var e apiErr
	if code != want || json.Unmarshal(b, &e) != nil || e.Error.Type != typ || !strings.Contains(e.Error.Message, says) {
		c.t.Errorf("%s %s: %d %s, want %d %s saying %q", method, path, code, b, want, typ, says)
	}
}

func (c *client) episode(id string) view {
	c.t.Helper()
	var v view
	c.call("GET", "/v1/episodes/"+id, nil, http.StatusOK, &v)
	return v
}

func (c *client) list(query string) []view {
	c.t.Helper()
	var l struct {
		Episodes []view `json:"episodes"`
	}
	c.call("GET", "/v1/episodes"+query, nil, http.StatusOK, &l)
	return l.Episodes
}

// waitExited polls an episode until its supervisor has exited.
func (c *client) waitExited(ctx context.Context, id string) view {
	c.t.Helper()
	for {
		v := c.episode(id)
		if v.Status != nil && v.Status.State == "exited" {
			if r := v.Status.Receipt; r == nil || r.ReturnCode == nil || *r.ReturnCode != 0 || !r.CleanupConfirmed {
				c.t.Fatalf("%s ended badly: %+v", id, v.Status.Receipt)
			}
			return v
		}
		if !v.Live {
			c.t.Fatalf("%s is not live: %+v", id, v)
		}
		select {
		case <-ctx.Done():
			c.t.Fatalf("%s did not end: %+v", id, v.Status)
		case <-time.After(100 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
}

// verify verifies an episode and expects reward 1.
func (c *client) verify(id string, recorded bool) task.Verdict {
	c.t.Helper()
	var vr verifyResponse
	c.call("POST", "/v1/episodes/"+id+"/verify", nil, http.StatusOK, &vr)
	if vr.Verdict.Reward != 1 || vr.Recorded != recorded || vr.Verdict.Episode != id {
		c.t.Fatalf("verify %s: reward %d recorded %v (want %v): %v %v\n%s", id, vr.Verdict.Reward, vr.Recorded, recorded,
			vr.Verdict.FailToPass, vr.Verdict.PassToPass, vr.Verdict.Output)
	}
	return vr.Verdict
}

// hold holds call n of attempt 0 of one episode at the gateway until it
// is released; its middleware goes to startServer.
func hold(episode string, n int) (*relay.Hold, func(http.Handler) http.Handler) {
	var hs relay.Holds
	return hs.Add(episode, n), hs.Middleware
}

// arrived waits until the held call has arrived, failing with never (what
// did not come) when ctx ends first.
func arrived(t *testing.T, ctx context.Context, g *relay.Hold, never string) {
	t.Helper()
	if err := g.Wait(ctx, 1); err != nil {
		t.Fatal(never)
	}
}

// running is a server under test behind httptest.
type running struct {
	srv *server.Server
	ts  *httptest.Server
	api *client
}

func (r *running) Close() {
	r.ts.Close()
	if err := r.srv.Close(); err != nil {
		r.api.t.Error(err)
	}
}

// startServer starts a server on state, in this process.
func startServer(t *testing.T, ctx context.Context, state string, mw func(http.Handler) http.Handler) *running {
	t.Helper()
	srv, err := server.New(ctx, server.Options{Config: system.Config{
		State: state, Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Binary: stasistest.Exe(), BinaryEnv: binaryEnv,
		GatewayMiddleware: mw, Concurrency: 4,
	}})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	return &running{srv: srv, ts: ts, api: &client{t: t, base: ts.URL}}
}

// cleanState makes sure, at the end of a test, that no sandbox of state
// is left (deleting any a failure left), then removes the gateway's socket
// directory and checks that no process is left.
func cleanState(t *testing.T, state string) {
	t.Helper()
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) }) // runs last
	sock, err := server.GatewaySocket(state)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(filepath.Dir(sock)); err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(func() {
		p, err := local.New(local.Options{Home: filepath.Join(state, "local"), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
		if err != nil {
			t.Error(err)
			return
		}
		left, err := p.List(context.Background(), nil)
		if err != nil {
			t.Error(err)
		}
		for _, sb := range left {
			t.Errorf("sandbox %s left behind (%s)", sb.ID, sb.State)
			if err := p.Delete(context.Background(), sb.ID); err != nil {
				t.Error(err)
			}
		}
	})
}

// The API end to end with real episodes: three mini episodes (the third
// held at its third model call), list with filters, verify (capture once),
// a checkpoint while one runs, a crash (server closed, every sandbox
// killed), a new server that finds the held episode lost, a restore that
// relaunches it to reward 1, retire, delete the checkpoint; and every kind
// of bad request.
func TestAPI(t *testing.T) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	g, mw := hold("ep-c", 3)
	defer g.Release()
	r := startServer(t, ctx, state, mw)
	closed := false
	defer func() {
		if !closed {
			r.Close()
		}
	}()
	api := r.api
	lap := func(what string) { t.Logf("%6.1fs %s", time.Since(start).Seconds(), what) }

	// Three episodes at once.
	eps := []struct{ id, task string }{{"ep-a", "py-ini-value-with-equals"}, {"ep-b", "sh-renext-spaces"}, {"ep-c", "sh-envget-unanchored-key"}}
	var wg sync.WaitGroup
	started := make([]view, len(eps))
	codes := make([]int, len(eps))
	bodies := make([][]byte, len(eps))
	for i, e := range eps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := map[string]any{"id": e.id, "task": e.task, "harness": "mini"}
			if e.id == "ep-c" {
				req["limits"] = map[string]any{"pids": 512, "memory_bytes": 1 << 30}
			}
			code, b := api.do("POST", "/v1/episodes", req)
			codes[i], bodies[i] = code, b
			_ = json.Unmarshal(b, &started[i])
		}()
	}
	wg.Wait()
	for i, e := range eps {
		v := started[i]
		if codes[i] != http.StatusCreated || v.ID != e.id || v.Task != e.task || v.Harness != "mini" || v.Provider != "local" ||
			v.State != store.EpisodeRunning || !v.Live || v.Sandbox == "" || v.TokenPath != "/tmp/stasis/"+e.id+"/token.json" || v.Reward != nil {
			t.Fatalf("start %s: %d %s", e.id, codes[i], bodies[i])
		}
	}
	lap("three episodes started")
	api.refuse("POST", "/v1/episodes", map[string]any{"id": "ep-a", "task": "sh-renext-spaces", "harness": "mini"}, 409, "conflict", "already exists")

	var tl struct {
		Tasks []server.TaskSummary `json:"tasks"`
	}
	api.call("GET", "/v1/tasks", nil, 200, &tl)
	found := false
	for _, tk := range tl.Tasks {
		if tk.ID == "sh-renext-spaces" {
			found = tk.BudgetS > 0 && tk.FailToPass > 0 && tk.Language != ""
		}
	}
	if len(tl.Tasks) < 3 || !found {
		t.Errorf("GET /v1/tasks: %+v", tl.Tasks)
	}

	// Lists and filters (by state below, once ep-a and ep-b have ended).
	if l := api.list("?task=py-ini-value-with-equals"); len(l) != 1 || l[0].ID != "ep-a" {
		t.Errorf("task filter: %+v", l)
	}
	if l := api.list("?harness=mini&task=sh-renext-spaces"); len(l) != 1 || l[0].ID != "ep-b" {
		t.Errorf("two filters: %+v", l)
	}
	if l := api.list("?harness=opencode"); len(l) != 0 {
		t.Errorf("harness=opencode: %+v", l)
	}
	api.refuse("GET", "/v1/episodes?state=sleeping", nil, 400, "invalid_request", "state")

	// ep-c is held at its third model call: its harness has not ended.
	arrived(t, ctx, g, "ep-c's third model call never came")
	api.refuse("POST", "/v1/episodes/ep-c/verify", nil, 409, "conflict", "has not ended")

	// ep-a and ep-b run to the end; verify twice each (capture once).
	for _, id := range []string{"ep-a", "ep-b"} {
		api.waitExited(ctx, id)
	}
	lap("ep-a and ep-b exited")
	// An episode whose harness has ended is ended before any verify; ep-c
	// still runs (held).
	if l := api.list("?state=running"); len(l) != 1 || l[0].ID != "ep-c" {
		t.Errorf("state=running: %+v", l)
	}
	if l := api.list("?harness=mini&state=ended&task=sh-renext-spaces"); len(l) != 1 || l[0].ID != "ep-b" || l[0].State != store.EpisodeEnded {
		t.Errorf("three filters: %+v", l)
	}
	for _, id := range []string{"ep-a", "ep-b"} {
		first := api.verify(id, false)
		second := api.verify(id, true)
		if !first.Started.Equal(second.Started) {
			t.Errorf("%s: the second verify ran again", id)
		}
		v := api.episode(id)
		if v.State != store.EpisodeEnded || v.Reward == nil || *v.Reward != 1 || v.ModelCalls < 3 || !v.LedgerOK || !v.Live {
			t.Errorf("%s after verify: %+v", id, v)
		}
	}
	if l := api.list("?state=ended"); len(l) != 2 {
		t.Errorf("state=ended: %d episodes", len(l))
	}
	lap("verified")

	// A checkpoint while ep-c runs (held): ep-a and ep-b are recorded
	// finished, ep-c paused and snapshotted, then continued.
	var ck server.CheckpointResponse
	api.call("POST", "/v1/checkpoints", map[string]any{"id": "ckpt-api-1"}, 201, &ck)
	if ck.Checkpoint != "ckpt-api-1" || len(ck.Episodes) != 3 || ck.ContinueError != "" {
		t.Fatalf("checkpoint: %+v", ck)
	}
	figs := map[string]coordinator.EpisodeFigures{}
	for _, f := range ck.Episodes {
		figs[f.Episode] = f
	}
	if !figs["ep-a"].Finished || !figs["ep-b"].Finished || figs["ep-c"].Finished || figs["ep-c"].Snapshot == "" {
		t.Fatalf("checkpoint figures: %+v", ck.Episodes)
	}
	if st := api.episode("ep-c").Status; st == nil || st.State != "running" {
		t.Fatalf("ep-c after the checkpoint: %+v", st)
	}
	lap("checkpoint taken")
	api.refuse("POST", "/v1/checkpoints", map[string]any{"id": "ckpt-api-1"}, 409, "conflict", "exists")
	api.refuse("POST", "/v1/checkpoints/ckpt-api-1/restore", nil, 409, "conflict", "live")

	// A default id, and an empty body, take a checkpoint too.
	var ck2 server.CheckpointResponse
	api.call("POST", "/v1/checkpoints", nil, 201, &ck2)
	if !strings.HasPrefix(ck2.Checkpoint, "ckpt-") || len(ck2.Episodes) != 3 {
		t.Fatalf("checkpoint with a default id: %+v", ck2)
	}

	// Checkpoints: list, get.
	var cl struct {
		Checkpoints []store.Checkpoint `json:"checkpoints"`
	}
	api.call("GET", "/v1/checkpoints?state=committed", nil, 200, &cl)
	if len(cl.Checkpoints) != 2 || cl.Checkpoints[1].ID != "ckpt-api-1" || cl.Checkpoints[1].Episodes != 3 {
		t.Fatalf("checkpoints: %+v", cl.Checkpoints)
	}
	api.call("GET", "/v1/checkpoints?limit=1", nil, 200, &cl)
	if len(cl.Checkpoints) != 1 || cl.Checkpoints[0].ID != ck2.Checkpoint {
		t.Fatalf("checkpoints, limit 1: %+v", cl.Checkpoints)
	}
	var cd struct {
		Checkpoint store.Checkpoint  `json:"checkpoint"`
		Records    []json.RawMessage `json:"records"`
	}
	api.call("GET", "/v1/checkpoints/ckpt-api-1", nil, 200, &cd)
	if cd.Checkpoint.State != store.StateCommitted || len(cd.Records) != 3 {
		t.Fatalf("checkpoint detail: %+v", cd)
	}
	var rc store.Record
	if err := json.Unmarshal(cd.Records[2], &rc); err != nil || rc.Episode != "ep-c" || rc.SnapshotID != figs["ep-c"].Snapshot || rc.Finished {
		t.Fatalf("ep-c's record: %+v %v", rc, err)
	}
	// The second checkpoint goes; its snapshot of ep-c is freed.
	var freed struct {
		Freed []store.SnapshotRef `json:"freed"`
	}
	api.call("DELETE", "/v1/checkpoints/"+ck2.Checkpoint, nil, 200, &freed)
	if len(freed.Freed) != 1 || freed.Freed[0].SnapshotID == figs["ep-c"].Snapshot {
		t.Fatalf("freed: %+v", freed)
	}
	api.refuse("GET", "/v1/checkpoints/"+ck2.Checkpoint, nil, 404, "not_found", "not found")

	// Metrics of this server.
	_, m := api.do("GET", "/metrics", nil)
	for _, want := range []string{
		`stasis_server_requests_total{code="201",route="POST /v1/episodes"} 3`,
		`stasis_server_checkpoints_total{result="committed"} 2`,
		`stasis_server_checkpoint_seconds_count 2`,
		`stasis_server_episodes{state="ended"} 2`,
		`stasis_server_episodes{state="running"} 1`,
		`stasis_server_live_episodes 3`,
		"\ngo_goroutines ", "\nprocess_resident_memory_bytes ", "\nprocess_open_fds ",
	} {
		if !strings.Contains(string(m), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// The crash: the server goes, and every sandbox is killed. (Closed
	// while sandboxes run, the server leaves its socket directory to them.)
	r.Close()
	closed = true
	if sock, _ := server.GatewaySocket(state); !dirExists(filepath.Dir(sock)) {
		t.Fatalf("the server removed %s while sandboxes bind it", filepath.Dir(sock))
	}
	g.Release()
	n, err := local.Crash(filepath.Join(state, "local"))
	if err != nil || n != 3 {
		t.Fatalf("crash: %d sandboxes killed, %v", n, err)
	}
	lap("crashed")

	// A new server on the same state: ep-c is lost; ep-a and ep-b keep
	// their verdicts (ended, or lost with their sandboxes: the coordinator
	// decides).
	r = startServer(t, ctx, state, nil)
	closed = false
	api = r.api
	lap("new server")
	if v := api.episode("ep-c"); v.State != store.EpisodeLost || v.Live || v.Status != nil || v.ModelCalls != 2 {
		t.Fatalf("ep-c after the crash: %+v", v)
	}
	if v := api.episode("ep-a"); v.State != store.EpisodeEnded && v.State != store.EpisodeLost || v.Live || v.Reward == nil || *v.Reward != 1 {
		t.Fatalf("ep-a after the crash: %+v", v)
	}
	api.verify("ep-a", true)
	api.refuse("POST", "/v1/episodes/ep-c/verify", nil, 409, "conflict", "restore it first")

	// The restore relaunches ep-c from its snapshot; it runs to reward 1.
	var res coordinator.Result
	api.call("POST", "/v1/checkpoints/ckpt-api-1/restore", nil, 200, &res)
	how := map[string]string{}
	for _, f := range res.Episodes {
		how[f.Episode] = f.Resume
	}
	if len(res.Episodes) != 3 || how["ep-c"] != "relaunch" || how["ep-a"] != "none" || how["ep-b"] != "none" {
		t.Fatalf("restore: %+v", res)
	}
	if v := api.episode("ep-c"); v.State != store.EpisodeRunning || !v.Live || v.Attempt != 1 || v.Resume != "relaunch" {
		t.Fatalf("ep-c after the restore: %+v", v)
	}
	lap("restored")
	// Its limits went with it into its new sandbox; the others have the
	// server's.
	if got := pidsMax(t, state, api.episode("ep-c").Sandbox); got != "512" {
		t.Errorf("ep-c's relaunched sandbox: pids.max %q, want its own limit 512", got)
	}
	api.waitExited(ctx, "ep-c")
	api.verify("ep-c", false)
	if v := api.episode("ep-c"); !v.LedgerOK || v.ModelCalls < 3 || v.Reward == nil || *v.Reward != 1 {
		t.Fatalf("ep-c at the end: %+v", v)
	}
	lap("ep-c relaunched, verified")

	// Retire everything; the checkpoint goes and frees ep-c's snapshot.
	for _, e := range eps {
		var v view
		api.call("POST", "/v1/episodes/"+e.id+"/retire", nil, 200, &v)
		if v.State != store.EpisodeRetired || v.Live || v.Reward == nil || *v.Reward != 1 {
			t.Errorf("%s after retire: %+v", e.id, v)
		}
	}
	if l := api.list("?state=retired"); len(l) != 3 {
		t.Errorf("state=retired: %d", len(l))
	}
	// A restore naming nothing leaves retired episodes out, each with
	// why; named, a retired episode comes back from a checkpoint (a
	// trainer rolling back); then it is retired again.
	var left server.RestoreResponse
	api.call("POST", "/v1/checkpoints/ckpt-api-1/restore", nil, 200, &left)
	if len(left.Episodes) != 3 || !left.Episodes[0].Excluded || !strings.Contains(left.Episodes[0].Reason, "retired") {
		t.Errorf("a restore of retired episodes, unnamed: %+v", left.Episodes)
	}
	if v := api.episode("ep-c"); v.Live {
		t.Errorf("ep-c came back unnamed: %+v", v)
	}
	api.call("POST", "/v1/checkpoints/ckpt-api-1/restore", map[string]any{"episodes": []string{"ep-b", "ep-c"}}, 200, nil)
	if v := api.episode("ep-c"); !v.Live || v.Resume != "relaunch" {
		t.Errorf("ep-c restored after its retirement: %+v", v)
	}
	for _, e := range eps {
		api.call("POST", "/v1/episodes/"+e.id+"/retire", nil, 200, nil)
	}
	api.call("DELETE", "/v1/checkpoints/ckpt-api-1", nil, 200, &freed)
	if len(freed.Freed) != 1 || freed.Freed[0].SnapshotID != figs["ep-c"].Snapshot {
		t.Fatalf("freed: %+v", freed)
	}
	api.refuse("DELETE", "/v1/checkpoints/ckpt-api-1", nil, 404, "not_found", "not found")

	// Bad requests.
	big := `{"task": "` + strings.Repeat("x", server.MaxBody) + `", "harness": "mini"}`
	for _, c := range []struct {
		method, path string
		body         any
		code         int
		typ, says    string
	}{
		{"POST", "/v1/episodes", `{"task": "sh-renext-spaces", "harness": `, 400, "invalid_request", "JSON"},
		{"POST", "/v1/episodes", `{"task": "sh-renext-spaces", "harness": "mini"} {}`, 400, "invalid_request", "after"},
		{"POST", "/v1/episodes", ``, 400, "invalid_request", "JSON object"},
		{"POST", "/v1/episodes", `["sh-renext-spaces"]`, 400, "invalid_request", "JSON"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "colour": "red"}, 400, "invalid_request", `unknown field "colour"`},
		{"POST", "/v1/episodes", map[string]any{"task": "no-such-task", "harness": "mini"}, 400, "invalid_request", `no task "no-such-task"`},
		{"POST", "/v1/episodes", map[string]any{"harness": "mini"}, 400, "invalid_request", `"task" is required`},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "claude"}, 400, "invalid_request", `no harness "claude"`},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "pause_mode": "hold"}, 400, "invalid_request", "file-only"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "pause_mode": "freeze"}, 400, "invalid_request", "pause mode"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "provider": "modal"}, 400, "invalid_request", "local provider only"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "deadline_s": -5}, 400, "invalid_request", "deadline_s"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "deadline_s": 0}, 400, "invalid_request", "deadline_s"},
		{"POST", "/v1/episodes", map[string]any{"id": "../x", "task": "sh-renext-spaces", "harness": "mini"}, 400, "invalid_request", "episode id"},
		{"POST", "/v1/episodes", big, 413, "too_large", "over"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "limits": map[string]any{"pids": 3}}, 400, "invalid_request", "pids limit 3"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "limits": map[string]any{"memory_bytes": -1}}, 400, "invalid_request", "negative"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "limits": map[string]any{"cpu_weight": 20000}}, 400, "invalid_request", "cpu weight"},
		{"POST", "/v1/episodes", map[string]any{"task": "sh-renext-spaces", "harness": "mini", "limits": map[string]any{"swap": 1}}, 400, "invalid_request", `unknown field "swap"`},
		{"POST", "/v1/checkpoints", map[string]any{"stragglers": "ignore"}, 400, "invalid_request", "stragglers"},
		{"POST", "/v1/checkpoints", `{"id": 7}`, 400, "invalid_request", "JSON"},
		{"POST", "/v1/checkpoints", `{"id": "a b"}`, 400, "invalid_request", "checkpoint id"},
		{"POST", "/v1/checkpoints", `{"name": "x"}`, 400, "invalid_request", `unknown field "name"`},
		{"GET", "/v1/checkpoints?state=done", nil, 400, "invalid_request", "state"},
		{"GET", "/v1/checkpoints?limit=-1", nil, 400, "invalid_request", "limit"},
		{"GET", "/v1/episodes/ep-nope", nil, 404, "not_found", "ep-nope"},
		{"POST", "/v1/episodes/ep-nope/verify", nil, 404, "not_found", "ep-nope"},
		{"POST", "/v1/episodes/ep-nope/retire", nil, 404, "not_found", "ep-nope"},
		{"GET", "/v1/checkpoints/ckpt-nope", nil, 404, "not_found", "ckpt-nope"},
		{"POST", "/v1/checkpoints/ckpt-nope/restore", nil, 404, "not_found", "ckpt-nope"},
		{"DELETE", "/v1/checkpoints/ckpt-nope", nil, 404, "not_found", "ckpt-nope"},
	} {
		api.refuse(c.method, c.path, c.body, c.code, c.typ, c.says)
	}
	if l := api.list(""); len(l) != 3 {
		t.Errorf("a bad request started an episode: %d episodes", len(l))
	}

	// Liveness, the document, the gateway's endpoint, this server's metrics.
	if code, b := api.do("GET", "/healthz", nil); code != 200 || strings.TrimSpace(string(b)) != "ok" {
		t.Errorf("/healthz: %d %s", code, b)
	}
	if code, b := api.do("GET", "/openapi.json", nil); code != 200 || !bytes.Equal(b, openapi.Raw(openapi.Server)) {
		t.Errorf("/openapi.json: %d", code)
	}
	if code, b := api.do("GET", "/gateway/v1/models", nil); code != 404 {
		t.Errorf("/gateway/v1/models on the API: %d %s (the gateway is served on the sandboxes' sockets only)", code, b)
	}
	_, m = api.do("GET", "/metrics", nil)
	for _, want := range []string{
		"stasis_gateway_calls_total",
		`stasis_server_restores_total{result="restored"} 3`,
		`stasis_server_restore_seconds_count 3`,
		`stasis_server_episodes{state="retired"} 3`,
		`stasis_server_live_episodes 0`,
		`stasis_server_requests_total{code="413",route="POST /v1/episodes"} 1`,
		`stasis_server_request_seconds_count{code="200",route="POST /v1/episodes/{id}/verify"}`,
	} {
		if !strings.Contains(string(m), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	r.Close()
	closed = true
	// No sandbox runs: the gateway's socket directory is gone with the server.
	if sock, _ := server.GatewaySocket(state); dirExists(filepath.Dir(sock)) {
		t.Errorf("%s is left after the last sandbox and the server", filepath.Dir(sock))
	}
	lap("done")
}

// pidsMax reads pids.max of a local sandbox's control group, from the
// directories its meta.json names.
func pidsMax(t *testing.T, state, sandboxID string) string {
	t.Helper()
	meta, err := os.ReadFile(filepath.Join(state, "local", "sandboxes", "local", sandboxID, "meta.json"))
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Cgroups struct {
			Dirs []string `json:"dirs"`
		} `json:"cgroups"`
	}
	if err := json.Unmarshal(meta, &m); err != nil {
		t.Fatal(err)
	}
	for _, d := range m.Cgroups.Dirs {
		if b, err := os.ReadFile(filepath.Join(d, "pids.max")); err == nil {
			return strings.TrimSpace(string(b))
		}
	}
	t.Fatalf("sandbox %s: no pids.max in its control groups %v (meta.json: %s)", sandboxID, m.Cgroups.Dirs, meta)
	return ""
}

func dirExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// TestOpenAPIMatchesHandlers: the server's document declares exactly the
// operations its handler routes, and each one answers: not the mux's 404
// or 405 (a 404 of an unknown episode or checkpoint is the API's JSON
// error).
func TestOpenAPIMatchesHandlers(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	cleanState(t, state)
	r := startServer(t, ctx, state, nil)
	defer r.Close()
	ops, err := openapi.Operations(openapi.Server)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, op := range ops {
		got = append(got, string(op))
	}
	// A ServeMux wildcard for the rest of a path, {name...}, is an OpenAPI
	// path parameter, {name}.
	routes := strings.ReplaceAll(strings.Join(r.srv.Routes(), "\n"), "...}", "}")
	if strings.Join(got, "\n") != routes {
		t.Errorf("the document declares\n%s\nthe handler routes\n%s", strings.Join(got, "\n"), routes)
	}
	h := r.srv.Handler()
	for _, op := range ops {
		method, path, _ := strings.Cut(string(op), " ")
		w := httptest.NewRecorder()
		q := httptest.NewRequest(method, path, strings.NewReader(`{"messages":[]}`))
		q.Host = "localhost" // as the server's clients send it
		q.Header.Set("Content-Type", "application/json")
		h.ServeHTTP(w, q)
		if w.Code == http.StatusMethodNotAllowed || w.Code == http.StatusNotFound && !strings.Contains(w.Body.String(), `"not_found"`) {
			t.Errorf("%s answers %d: %s", op, w.Code, w.Body)
		}
		if w.Code >= 500 {
			t.Errorf("%s answers %d: %s", op, w.Code, w.Body)
		}
	}
	for _, op := range []string{"DELETE /v1/episodes", "PUT /v1/checkpoints", "GET /v1/nothing"} {
		method, path, _ := strings.Cut(op, " ")
		w := httptest.NewRecorder()
		q := httptest.NewRequest(method, path, nil)
		q.Host = "localhost"
		h.ServeHTTP(w, q)
		var e apiErr
		if w.Code != http.StatusNotFound && w.Code != http.StatusMethodNotAllowed || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Message == "" {
			t.Errorf("undeclared %s answered %d %s; want a JSON 404 or 405", op, w.Code, w.Body)
		}
		if w.Code == http.StatusMethodNotAllowed && (e.Error.Type != "method_not_allowed" || w.Header().Get("Allow") == "") {
			t.Errorf("%s: 405 %s with Allow %q", op, w.Body, w.Header().Get("Allow"))
		}
	}
	// Every operation says what it answers, and each schema it names exists.
	var doc struct {
		Paths      map[string]map[string]json.RawMessage `json:"paths"`
		Components struct {
			Schemas map[string]json.RawMessage `json:"schemas"`
		} `json:"components"`
	}
	raw := openapi.Raw(openapi.Server)
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	for path, methods := range doc.Paths {
		for m, b := range methods {
			var op struct {
				Responses map[string]json.RawMessage `json:"responses"`
			}
			if err := json.Unmarshal(b, &op); err != nil || len(op.Responses) == 0 {
				t.Errorf("%s %s: no responses (%v)", m, path, err)
			}
		}
	}
	for _, ref := range strings.Split(string(raw), `"$ref": "#/components/schemas/`)[1:] {
		name, _, _ := strings.Cut(ref, `"`)
		if _, ok := doc.Components.Schemas[name]; !ok {
			t.Errorf("the document refers to schema %s, which it lacks", name)
		}
	}
}

// TestCheckpointExcludesAStraggler: an episode whose supervisor refuses
// the server's pause (its sequence burned from inside the sandbox, as an
// agent once could) is excluded from a checkpoint over the API, with the
// reason in the answer, and does not block the next one; with
// "stragglers": "fail" the checkpoint fails naming it.
func TestCheckpointExcludesAStraggler(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	g, mw := hold("ep-bad", 2)
	defer g.Release()
	r := startServer(t, ctx, state, mw)
	defer r.Close()
	api := r.api
	var bad view
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-bad", "task": "sh-renext-spaces", "harness": "mini"}, 201, &bad)
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-good", "task": "sh-renext-spaces", "harness": "mini"}, 201, nil)
	arrived(t, ctx, g, "ep-bad's second model call never came")
	api.waitExited(ctx, "ep-good")
	// Burn ep-bad's sequence as stasis's user in its sandbox.
	lp, err := local.New(local.Options{Home: filepath.Join(state, "local"), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	for _, op := range []string{"pause", "continue"} {
		var out strings.Builder
		res, err := lp.Exec(ctx, bad.Sandbox, sandbox.ExecRequest{
			Argv: []string{harness.BoundBinaryPath, "ctl", "--dir", "/tmp/stasis/ep-bad", op, "1000000"},
			Env:  stasistest.EnvMap, User: sandbox.UserControl, Stdout: &out, Stderr: &out,
		})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("burn ep-bad's sequence (%s): %v %+v %s", op, err, res, out.String())
		}
	}
	for _, id := range []string{"ckpt-s1", "ckpt-s2"} {
		var ck server.CheckpointResponse
		api.call("POST", "/v1/checkpoints", map[string]any{"id": id}, 201, &ck)
		got := map[string]coordinator.EpisodeFigures{}
		for _, f := range ck.Episodes {
			got[f.Episode] = f
		}
		t.Logf("%s: ep-bad: %+v", id, got["ep-bad"])
		if f := got["ep-bad"]; !f.Excluded || !strings.Contains(f.Reason, "refused pause") || f.Snapshot != "" {
			t.Errorf("%s: ep-bad %+v, want excluded with a reason", id, f)
		}
		if f := got["ep-good"]; f.Excluded || !f.Finished {
			t.Errorf("%s: ep-good %+v, want recorded finished", id, f)
		}
	}
	api.refuse("POST", "/v1/checkpoints", map[string]any{"id": "ckpt-strict", "stragglers": "fail"}, 409, "conflict", "episode ep-bad")
	var cd struct {
		Checkpoint store.Checkpoint `json:"checkpoint"`
	}
	api.call("GET", "/v1/checkpoints/ckpt-strict", nil, 200, &cd)
	if cd.Checkpoint.State != store.StateFailed {
		t.Errorf("ckpt-strict: %+v, want failed", cd.Checkpoint)
	}
	g.Release()
	api.waitExited(ctx, "ep-bad")
	for _, id := range []string{"ep-bad", "ep-good"} {
		api.call("POST", "/v1/episodes/"+id+"/retire", nil, 200, nil)
	}
	for _, id := range []string{"ckpt-s1", "ckpt-s2"} {
		api.call("DELETE", "/v1/checkpoints/"+id, nil, 200, nil)
	}
}

// TestEpisodeOverItsLimitEnds: an episode started with its own pids limit
// (room for its harness and supervisor, whose Go threads count too) forks
// past it while its second model call is held; its sandbox is ended, the episode's view says why,
// a checkpoint leaves it out with that reason, and a neighbour episode
// without the limit runs to its reward.
func TestEpisodeOverItsLimitEnds(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	g, mw := hold("ep-bomb", 2)
	defer g.Release()
	r := startServer(t, ctx, state, mw)
	defer r.Close()
	api := r.api
	var bomb view
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-bomb", "task": "sh-renext-spaces", "harness": "mini", "limits": map[string]any{"pids": 128}}, 201, &bomb)
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-next", "task": "sh-renext-spaces", "harness": "mini"}, 201, nil)
	wctx, cancelWait := context.WithTimeout(ctx, 3*time.Minute)
	defer cancelWait()
	if err := g.Wait(wctx, 1); err != nil {
		t.Fatalf("ep-bomb's second model call never came: %+v", api.episode("ep-bomb"))
	}
	lp, err := local.New(local.Options{Home: filepath.Join(state, "local"), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
	if err != nil {
		t.Fatal(err)
	}
	// The agent forks past its limit (the forks beyond it fail; the
	// keeper then ends the sandbox).
	_, _ = lp.Exec(ctx, bomb.Sandbox, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", "for i in $(seq 1 400); do sleep 60 & done; wait"}, Timeout: time.Minute,
	})
	for {
		v := api.episode("ep-bomb")
		if strings.Contains(v.StatusError, "pids limit") {
			t.Logf("ep-bomb: %s", v.StatusError)
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("ep-bomb's view never said it was ended by its pids limit: %+v", v)
		case <-time.After(100 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
	api.waitExited(ctx, "ep-next")
	api.verify("ep-next", false)
	var ck server.CheckpointResponse
	api.call("POST", "/v1/checkpoints", map[string]any{"id": "ckpt-limit"}, 201, &ck)
	for _, f := range ck.Episodes {
		switch f.Episode {
		case "ep-bomb":
			if !f.Excluded || !strings.Contains(f.Reason, "pids limit") {
				t.Errorf("ep-bomb in the checkpoint: %+v, want excluded for its pids limit", f)
			}
		case "ep-next":
			if f.Excluded || !f.Finished {
				t.Errorf("ep-next in the checkpoint: %+v", f)
			}
		}
	}
	g.Release()
	for _, id := range []string{"ep-bomb", "ep-next"} {
		api.call("POST", "/v1/episodes/"+id+"/retire", nil, 200, nil)
	}
	api.call("DELETE", "/v1/checkpoints/ckpt-limit", nil, 200, nil)
}

// TestBranch: one episode of a committed checkpoint, taken while its third
// model call was held, continues as two copies through the API; each is
// relaunched from the snapshot's saved session in a fork of its own (the
// local provider keeps files only), finishes with reward 1 on a ledger of
// its own that verifies, and names its origin; the original goes on and
// finishes too. Bad branches change nothing.
func TestBranch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	g, mw := hold("ep-o", 3)
	defer g.Release()
	r := startServer(t, ctx, state, mw)
	defer r.Close()
	api := r.api
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-o", "task": "sh-envget-unanchored-key", "harness": "mini"}, 201, nil)
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-done", "task": "sh-renext-spaces", "harness": "mini"}, 201, nil)
	arrived(t, ctx, g, "ep-o's third model call never came")
	api.waitExited(ctx, "ep-done")
	api.call("POST", "/v1/checkpoints", map[string]any{"id": "ckpt-b"}, 201, nil)

	// Refusals, before anything is made.
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{}, 400, "invalid_request", `"episode" is required`)
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-o", "copies": 65}, 400, "invalid_request", "copies 65")
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-o", "copies": 2, "ids": []string{"x"}}, 400, "invalid_request", "as many ids")
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-o", "ids": []string{"../x"}}, 400, "invalid_request", "episode id")
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-nope"}, 404, "not_found", "ep-nope")
	api.refuse("POST", "/v1/checkpoints/ckpt-nope/branch", map[string]any{"episode": "ep-o"}, 404, "not_found", "ckpt-nope")
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-done"}, 409, "conflict", "had ended")
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-o", "ids": []string{"ep-done"}}, 409, "conflict", "exists")
	api.refuse("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-o", "ids": []string{"c1", "c1"}}, 409, "conflict", "named twice")
	if l := api.list(""); len(l) != 2 {
		t.Fatalf("a refused branch left episodes: %+v", l)
	}

	var res coordinator.Result
	api.call("POST", "/v1/checkpoints/ckpt-b/branch", map[string]any{"episode": "ep-o", "copies": 2}, 201, &res)
	if len(res.Episodes) != 2 || res.Episodes[0].Episode != "ep-o-b1" || res.Episodes[1].Episode != "ep-o-b2" {
		t.Fatalf("branch: %+v", res)
	}
	for _, f := range res.Episodes {
		if f.Resume != "relaunch" {
			t.Errorf("%s: resume %q (%s), want relaunch on the local provider", f.Episode, f.Resume, f.ResumeWhy)
		}
	}
	g.Release()
	sandboxes := map[string]bool{}
	for _, id := range []string{"ep-o-b1", "ep-o-b2", "ep-o"} {
		v := api.waitExited(ctx, id)
		if sandboxes[v.Sandbox] {
			t.Fatalf("%s shares sandbox %s", id, v.Sandbox)
		}
		sandboxes[v.Sandbox] = true
		if id != "ep-o" && (v.Origin != "ep-o" || v.Attempt < 1) {
			t.Errorf("%s: origin %q attempt %d", id, v.Origin, v.Attempt)
		}
		api.verify(id, false)
		if v := api.episode(id); v.Reward == nil || *v.Reward != 1 || !v.LedgerOK {
			t.Errorf("%s after verify: %+v", id, v)
		}
	}
	// Each copy's ledger is its own: the original's first two entries,
	// copied, then its own calls after the relaunch boundary.
	for _, id := range []string{"ep-o-b1", "ep-o-b2"} {
		hist, err := ledger.Read(filepath.Join(state, "gateway", "ledgers"), id)
		if err != nil {
			t.Fatal(err)
		}
		boundary := -1
		for i, en := range hist.Entries {
			if en.Boundary {
				boundary = i
			}
			if !strings.HasPrefix(en.CallID, "ep-o/") && !strings.HasPrefix(en.CallID, id+"/") {
				t.Errorf("%s: entry %d is call %s", id, i, en.CallID)
			}
		}
		if hist.Broken || boundary != 2 || len(hist.Entries) < 4 {
			t.Errorf("%s: %d entries, boundary at %d, broken %v", id, len(hist.Entries), boundary, hist.Broken)
		}
	}
	for _, id := range []string{"ep-o", "ep-o-b1", "ep-o-b2", "ep-done"} {
		api.call("POST", "/v1/episodes/"+id+"/retire", nil, 200, nil)
	}
	api.call("DELETE", "/v1/checkpoints/ckpt-b", nil, 200, nil)
}

// ledgerPage is the part of GET /v1/episodes/{id}/ledger the tests read.
type ledgerPage struct {
	ledger.History
	Live int64 `json:"live"`
	More bool  `json:"more"`
}

// TestLedgerRoutes: an episode's ledger over the API, whole and in pages,
// with and without bodies, its verify, an empty ledger before any model
// call, bad queries, unknown episodes, and a damaged file: refused by the
// read (409) and named by the verify, with nothing changed.
func TestLedgerRoutes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	state := t.TempDir()
	cleanState(t, state)
	g, mw := hold("ep-wait", 1)
	defer g.Release()
	r := startServer(t, ctx, state, mw)
	defer r.Close()
	api := r.api
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-l", "task": "sh-renext-spaces", "harness": "mini"}, 201, nil)
	api.call("POST", "/v1/episodes", map[string]any{"id": "ep-wait", "task": "sh-renext-spaces", "harness": "mini"}, 201, nil)
	arrived(t, ctx, g, "ep-wait's first model call never came")
	// Before its first call is answered, ep-wait's ledger is empty, and
	// verifies.
	var empty ledgerPage
	api.call("GET", "/v1/episodes/ep-wait/ledger", nil, 200, &empty)
	if empty.Episode != "ep-wait" || len(empty.Entries) != 0 || empty.Live != 0 || empty.More || empty.Entries == nil {
		t.Errorf("ep-wait before any answer: %+v", empty)
	}
	var rep ledger.Report
	api.call("GET", "/v1/episodes/ep-wait/ledger/verify", nil, 200, &rep)
	if !rep.OK || rep.Live != 0 {
		t.Errorf("ep-wait's verify before any answer: %+v", rep)
	}
	g.Release()
	v := api.waitExited(ctx, "ep-l")
	api.verify("ep-l", false)

	var whole ledgerPage
	api.call("GET", "/v1/episodes/ep-l/ledger", nil, 200, &whole)
	n := int64(len(whole.Entries))
	if n < 2 || n != whole.Live || n != v.ModelCalls || whole.More || whole.Broken {
		t.Fatalf("ep-l's ledger: %d entries, live %d, more %v, broken %v; the episode made %d calls", n, whole.Live, whole.More, whole.Broken, v.ModelCalls)
	}
	for i, e := range whole.Entries {
		if e.Seq != int64(i+1) || e.Tokens == nil || len(e.Tokens.CompletionIDs) == 0 || len(e.Tokens.Logprobs) != len(e.Tokens.CompletionIDs) || len(e.Request) == 0 || len(e.Response) == 0 {
			t.Errorf("entry %d: seq %d tokens %+v request %d bytes", i, e.Seq, e.Tokens, len(e.Request))
		}
		if e.Disposition != ledger.Delivered {
			t.Errorf("entry %d of an ended episode: %s, want delivered", e.Seq, e.Disposition)
		}
	}
	// The same as the file says (stasis ledger show --json).
	file, err := ledger.Read(filepath.Join(state, "gateway", "ledgers"), "ep-l")
	if err != nil {
		t.Fatal(err)
	}
	if a, b := mustJSON(t, file.Entries), mustJSON(t, whole.Entries); a != b {
		t.Errorf("the API's entries differ from the file's:\n%s\n%s", b, a)
	}
	// Pages of one, without bodies.
	var got []ledger.Entry
	after := int64(0)
	for {
		var p ledgerPage
		api.call("GET", "/v1/episodes/ep-l/ledger?limit=1&bodies=false&after="+strconv.FormatInt(after, 10), nil, 200, &p)
		if len(p.Entries) != 1 || p.Live != n {
			t.Fatalf("page after %d: %+v", after, p)
		}
		e := p.Entries[0]
		if string(e.Request) != "null" && e.Request != nil || e.Tokens == nil || e.Hash != whole.Entries[e.Seq-1].Hash {
			t.Errorf("page entry %d without bodies: request %s tokens %v", e.Seq, e.Request, e.Tokens)
		}
		got = append(got, e)
		after = e.Seq
		if !p.More {
			break
		}
	}
	if int64(len(got)) != n {
		t.Errorf("paging gave %d entries, want %d", len(got), n)
	}
	api.call("GET", "/v1/episodes/ep-l/ledger/verify", nil, 200, &rep)
	if !rep.OK || rep.Live != n || rep.Delivered != n || rep.Pending != 0 || rep.Head == "" {
		t.Errorf("ep-l's verify: %+v", rep)
	}

	for _, c := range []struct{ path, says string }{
		{"?after=-1", "after"}, {"?after=x", "after"}, {"?limit=0", "limit"}, {"?limit=10001", "limit"}, {"?bodies=maybe", "bodies"},
	} {
		api.refuse("GET", "/v1/episodes/ep-l/ledger"+c.path, nil, 400, "invalid_request", c.says)
	}
	api.refuse("GET", "/v1/episodes/ep-nope/ledger", nil, 404, "not_found", "ep-nope")
	api.refuse("GET", "/v1/episodes/ep-nope/ledger/verify", nil, 404, "not_found", "ep-nope")
	api.refuse("GET", "/v1/episodes/..%2Fx/ledger", nil, 404, "not_found", "")

	// A damaged file: one byte of the first entry changed.
	path := filepath.Join(state, "gateway", "ledgers", "ep-l.ledger")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := bytes.SplitAfter(b, []byte("\n"))
	lines[1] = bytes.Replace(lines[1], []byte(`"call_id":"ep-l/1"`), []byte(`"call_id":"ep-l/9"`), 1)
	bad := bytes.Join(lines, nil)
	if bytes.Equal(bad, b) {
		t.Fatal("the test could not damage the ledger")
	}
	if err := os.WriteFile(path, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	api.refuse("GET", "/v1/episodes/ep-l/ledger", nil, 409, "conflict", "damaged")
	api.call("GET", "/v1/episodes/ep-l/ledger/verify", nil, 200, &rep)
	if rep.OK || rep.Bad == nil || rep.Bad.Line != 2 {
		t.Errorf("verify of a damaged ledger: %+v", rep)
	}
	if after, err := os.ReadFile(path); err != nil || !bytes.Equal(after, bad) {
		t.Errorf("reading a damaged ledger changed it (%v)", err)
	}
	api.waitExited(ctx, "ep-wait")
	for _, id := range []string{"ep-l", "ep-wait"} {
		api.call("POST", "/v1/episodes/"+id+"/retire", nil, 200, nil)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
