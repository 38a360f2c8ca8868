package client_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"stasis/client"
	"stasis/errdefs"
	"stasis/internal/control/openapi"
	"stasis/internal/control/server"
	"stasis/internal/control/system"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// operations maps every operation of the API to the Client method that
// calls it; the server's own pages (metrics, health, the document) have
// none.
var operations = map[string]string{
	"POST /v1/episodes":                   "StartEpisode",
	"GET /v1/episodes":                    "Episodes",
	"GET /v1/episodes/{id}":               "Episode",
	"POST /v1/episodes/{id}/verify":       "Verify",
	"POST /v1/episodes/{id}/retire":       "Retire",
	"GET /v1/episodes/{id}/ledger":        "Ledger",
	"GET /v1/episodes/{id}/ledger/verify": "VerifyLedger",
	"GET /v1/tasks":                       "Tasks",
	"POST /v1/checkpoints":                "Checkpoint",
	"GET /v1/checkpoints":                 "Checkpoints",
	"GET /v1/checkpoints/{id}":            "GetCheckpoint",
	"POST /v1/checkpoints/{id}/restore":   "Restore",
	"POST /v1/checkpoints/{id}/branch":    "Branch",
	"DELETE /v1/checkpoints/{id}":         "DeleteCheckpoint",
	"GET /metrics":                        "",
	"GET /healthz":                        "",
	"GET /openapi.json":                   "",
}

// TestClientCoversEveryOperation: each operation the OpenAPI document
// declares has its Client method, and each method named exists.
func TestClientCoversEveryOperation(t *testing.T) {
	ops, err := openapi.Operations(openapi.Server)
	if err != nil {
		t.Fatal(err)
	}
	ct := reflect.TypeOf(&client.Client{})
	var declared []string
	for _, op := range ops {
		declared = append(declared, string(op))
		m, ok := operations[string(op)]
		if !ok {
			t.Errorf("%s: the client has no method for it", op)
			continue
		}
		if _, found := ct.MethodByName(m); m != "" && !found {
			t.Errorf("%s: no method Client.%s", op, m)
		}
	}
	for op := range operations {
		if !slices.Contains(declared, op) {
			t.Errorf("%s: the document no longer declares it", op)
		}
	}
}

// TestClientAgainstAServer drives a real server through the client: one
// mini episode to its end, its ledger and verify, a checkpoint, the lists,
// and the errors, each of its errdefs kind.
func TestClientAgainstAServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	state := t.TempDir()
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	srv, err := server.New(ctx, server.Options{Config: system.Config{
		State: state, Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Binary: stasistest.Exe(),
		BinaryEnv: map[string]string{"STASIS_TEST_AS_CLI": "1", "GORACE": "atexit_sleep_ms=0"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(func() {
		ts.Close()
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
		sock, _ := server.GatewaySocket(state)
		_ = os.RemoveAll(filepath.Dir(sock))
		p, err := local.New(local.Options{Home: filepath.Join(state, "local"), Exe: stasistest.Exe(), ExeEnv: stasistest.Env})
		if err == nil {
			left, _ := p.List(context.Background(), nil)
			for _, sb := range left {
				t.Errorf("sandbox %s left behind", sb.ID)
				_ = p.Delete(context.Background(), sb.ID)
			}
		}
	})
	c, err := client.New(ts.URL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.New("localhost:1"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("an address without a scheme: %v", err)
	}

	tasks, err := c.Tasks(ctx)
	if err != nil || len(tasks) == 0 {
		t.Fatalf("tasks: %v %v", tasks, err)
	}
	const task = "sh-renext-spaces"
	v, err := c.StartEpisode(ctx, client.StartRequest{ID: "e1", Task: task, Harness: "mini"})
	if err != nil || v.ID != "e1" || !v.Live {
		t.Fatalf("start: %+v %v", v, err)
	}
	if _, err := c.StartEpisode(ctx, client.StartRequest{ID: "e1", Task: task, Harness: "mini"}); !errors.Is(err, errdefs.ErrConflict) {
		t.Errorf("a second start of e1: %v", err)
	}
	var ce *client.Error
	if _, err := c.StartEpisode(ctx, client.StartRequest{ID: "e2", Task: "no/such", Harness: "mini"}); !errors.As(err, &ce) || ce.Status != http.StatusBadRequest || ce.Type != "invalid_request" || !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("an unknown task: %v", err)
	}
	// To its end.
	for {
		if v, err = c.Episode(ctx, "e1"); err != nil {
			t.Fatal(err)
		}
		if v.State == store.EpisodeEnded {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("e1 did not end: %+v", v)
		case <-time.After(100 * time.Millisecond): // polling the API, as a trainer would
		}
	}
	vr, err := c.Verify(ctx, "e1")
	if err != nil || vr.Verdict.Reward != 1 {
		t.Fatalf("verify: %+v %v", vr, err)
	}
	page, err := c.Ledger(ctx, "e1", 0, 1, false)
	if err != nil || len(page.Entries) != 1 || page.Live < 1 || !page.More || (page.Entries[0].Response != nil && string(page.Entries[0].Response) != "null") {
		t.Fatalf("ledger page: %+v %v", page, err)
	}
	if rep, err := c.VerifyLedger(ctx, "e1"); err != nil || !rep.OK {
		t.Fatalf("ledger verify: %+v %v", rep, err)
	}
	list, err := c.Episodes(ctx, client.ListOptions{State: store.EpisodeEnded, Task: task})
	if err != nil || len(list) != 1 || list[0].ID != "e1" {
		t.Fatalf("episodes: %+v %v", list, err)
	}
	if _, err := c.Episodes(ctx, client.ListOptions{State: "sideways"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("a bad state filter: %v", err)
	}

	ck, err := c.Checkpoint(ctx, client.CheckpointRequest{ID: "ck1"})
	if err != nil || ck.Checkpoint != "ck1" {
		t.Fatalf("checkpoint: %+v %v", ck, err)
	}
	cks, err := c.Checkpoints(ctx, store.StateCommitted, 10)
	if err != nil || len(cks) != 1 || cks[0].ID != "ck1" {
		t.Fatalf("checkpoints: %+v %v", cks, err)
	}
	got, recs, err := c.GetCheckpoint(ctx, "ck1")
	if err != nil || got.ID != "ck1" || len(recs) != 1 || recs[0].Episode != "e1" || !recs[0].Finished {
		t.Fatalf("get checkpoint: %+v %+v %v", got, recs, err)
	}
	if _, err := c.Branch(ctx, "ck1", client.BranchRequest{Episode: "e1", Copies: 1}); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "ended") {
		t.Errorf("a branch of an episode that had ended: %v", err)
	}
	if _, err := c.Restore(ctx, "nothing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("restore of an unknown checkpoint: %v", err)
	}
	if _, err := c.Retire(ctx, "e1"); err != nil {
		t.Fatal(err)
	}
	// A retired episode comes back only when a restore names it; it had
	// ended at the checkpoint, so it comes back ended, with its verdict.
	if _, err := c.RestoreWith(ctx, "ck1", client.RestoreRequest{Episodes: []string{"nobody"}}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a restore naming an episode the checkpoint lacks: %v", err)
	}
	if res, err := c.RestoreWith(ctx, "ck1", client.RestoreRequest{Episodes: []string{"e1"}}); err != nil || len(res.Episodes) != 1 || !res.Episodes[0].Finished {
		t.Fatalf("a restore naming e1: %+v %v", res, err)
	}
	if v, err := c.Episode(ctx, "e1"); err != nil || v.State != store.EpisodeEnded || v.Reward == nil || *v.Reward != 1 {
		t.Fatalf("e1 restored: %+v %v", v, err)
	}
	if _, err := c.Retire(ctx, "e1"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Retire(ctx, "nobody"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("retire of an unknown episode: %v", err)
	}
	if _, err := c.DeleteCheckpoint(ctx, "ck1"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.GetCheckpoint(ctx, "ck1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a deleted checkpoint: %v", err)
	}
}

// TestClientErrors: what the client makes of answers that are not the
// API's (a server gone, a body that is not JSON).
func TestClientErrors(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		if q.URL.Path == "/v1/tasks" {
			_, _ = w.Write([]byte("not json"))
			return
		}
		http.Error(w, "upstream is down", http.StatusServiceUnavailable)
	}))
	c, err := client.New(ts.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Tasks(context.Background()); err == nil || !strings.Contains(err.Error(), "not what the API documents") {
		t.Errorf("a body that is not JSON: %v", err)
	}
	var ce *client.Error
	if _, err := c.Episode(context.Background(), "e1"); !errors.As(err, &ce) || ce.Status != 503 || !errors.Is(err, errdefs.ErrUnavailable) || ce.Message != "upstream is down" {
		t.Errorf("a 503 of no API body: %v", err)
	}
	ts.Close()
	if _, err := c.Episode(context.Background(), "e1"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("a server gone: %v", err)
	}
}
