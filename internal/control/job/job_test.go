package job_test

import (
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/job"
	"stasis/internal/providers/e2b"
	"stasis/internal/providers/e2b/e2bfake"
	"stasis/internal/providers/local"
	"stasis/internal/providers/opensandbox/osfake"
	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// The main job with a crash: every episode is checkpointed mid-way, the
// server and the sandboxes are killed, the restore relaunches the episodes
// that were running, and every one of them is resolved with a ledger that
// verifies. Nothing is left running, and the state directory is removed.
func TestRunWithCrash(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 4, Harness: "mini", CheckpointAt: 0.4, Crash: true,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 4 || rep.Resolved != 4 || rep.Restore == nil || rep.Checkpoint.Episodes != 4 {
		t.Fatalf("report: %+v", rep)
	}
	relaunched := 0
	for _, e := range rep.Episodes {
		if !e.LedgerVerified || e.Reward != 1 || e.ModelCalls < 3 {
			t.Errorf("episode %+v", e)
		}
		if e.Resume == "relaunch" {
			relaunched++
		}
	}
	if relaunched == 0 {
		t.Errorf("no episode was relaunched: the checkpoint fell after every episode ended: %+v", rep.Episodes)
	}
	left, _ := filepath.Glob(filepath.Join(tmp, "stasis-run-*"))
	if len(left) != 0 {
		t.Fatalf("state left behind: %v", left)
	}
	if _, err := job.Run(ctx, job.Options{N: 1, Harness: "claude"}); err == nil {
		t.Fatal("an unknown harness ran")
	}
}

// The main job on the microVM provider: mini episodes on the shell tasks,
// hold pauses, a crash of the server and every VM, and a restore that
// resumes every running episode in place in a fork of its VM snapshot,
// with the guest clock kept continuous.
func TestRunOnMicroVM(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 3, Harness: "mini", Provider: "microvm", CheckpointAt: 0.4, Crash: true,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GuestBinary: stasistest.StaticBinary(t), TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 3 || rep.Resolved != 3 || rep.Restore == nil {
		t.Fatalf("report: %+v", rep)
	}
	inPlace := 0
	for _, e := range rep.Episodes {
		if !e.LedgerVerified || e.Reward != 1 || e.Provider != "microvm" {
			t.Errorf("episode %+v", e)
		}
		switch e.Resume {
		case "in_place":
			inPlace++
			if e.ClockStep == nil {
				t.Errorf("%s resumed in place with no clock fix reported", e.ID)
			}
		case "relaunch":
			t.Errorf("%s relaunched on the microVM provider: %s", e.ID, e.ResumeWhy)
		}
	}
	if inPlace == 0 {
		t.Errorf("no episode resumed in place: the checkpoint fell after every episode ended: %+v", rep.Episodes)
	}
	left, _ := filepath.Glob(filepath.Join(tmp, "stasis-run-*"))
	if len(left) != 0 {
		t.Fatalf("state left behind: %v", left)
	}
}

// runOnFake runs the main job (3 mini episodes, a crash) on a hosted
// provider against its fake, whose sandboxes are local bubblewrap
// sandboxes with no network: their relays reach the gateway by the URL the
// server is given, here a unix socket in a directory bound into them.
// serve starts the fake over the backend and returns its URL and a stop
// function; env is what the serve child needs to find it. Every episode
// must be resolved by a relaunch, and no sandbox may be left.
func runOnFake(t *testing.T, provider string, serve func(backend *local.Provider) (url string, stop func()), env func(url string) map[string]string) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	gwDir, sock, pipes := gatewayPipes(t)
	backend, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GatewayDir: gwDir, Gateway: pipes})
	if err != nil {
		t.Fatal(err)
	}
	url, stop := serve(backend)
	t.Cleanup(stop)
	for k, v := range env(url) {
		t.Setenv(k, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	t.Setenv("TMPDIR", t.TempDir())
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 3, Harness: "mini", Provider: provider, CheckpointAt: 0.4, Crash: true,
		GatewayListen: "unix:" + sock, GatewayURL: "unix://" + local.GatewayDirInSandbox + "/" + local.GatewaySocketName,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 3 || rep.Resolved != 3 || rep.Restore == nil {
		t.Fatalf("report: %+v", rep)
	}
	for _, e := range rep.Episodes {
		t.Logf("%s: resume %s %s", e.ID, e.Resume, e.ResumeWhy)
		if !e.LedgerVerified || e.Reward != 1 || e.Provider != provider || e.Resume == "in_place" {
			t.Errorf("episode %+v", e)
		}
		if e.Resume == "relaunch" && !strings.Contains(e.ResumeWhy, "kept files only") {
			t.Errorf("%s relaunched with no reason reported: %q", e.ID, e.ResumeWhy)
		}
	}
	if left, err := backend.List(ctx, nil); err != nil || len(left) != 0 {
		t.Fatalf("sandboxes left on the service: %v %v", left, err)
	}
}

// The main job on the OpenSandbox provider, against the fake server: stop
// pauses, a crash of the server with every sandbox deleted on the
// service, and a restore that relaunches the running episodes from their
// snapshots.
func TestRunOnOpenSandboxFake(t *testing.T) {
	runOnFake(t, "opensandbox", func(backend *local.Provider) (string, func()) {
		fake := osfake.New(osfake.Options{Backend: backend, APIKey: "test-key"})
		srv := httptest.NewServer(fake)
		return srv.URL, func() { srv.Close(); fake.Close() }
	}, func(url string) map[string]string {
		return map[string]string{"OPENSANDBOX_URL": url, "OPENSANDBOX_API_KEY": "test-key"}
	})
}

// The main job on the E2B provider, against the fake E2B: its snapshots
// keep files only, so the server is told so (E2B_FILE_ONLY_SNAPSHOTS) and
// pauses by stop; the restore relaunches.
func TestRunOnE2BFake(t *testing.T) {
	var fake *e2bfake.Server
	runOnFake(t, "e2b", func(backend *local.Provider) (string, func()) {
		fake = e2bfake.New(backend, e2bfake.Options{APIKey: "test-key"})
		srv := httptest.NewServer(fake)
		return srv.URL, func() { fake.Close(); srv.Close() } // the fake ends its processes first
	}, func(url string) map[string]string {
		return map[string]string{e2b.EnvAPIKey: "test-key", e2b.EnvDomain: "", e2b.EnvAPIURL: url, e2b.EnvSandboxURL: url, e2b.EnvFileOnlySnapshots: "1"}
	})
	if left := fake.Sandboxes(); len(left) != 0 {
		t.Errorf("sandboxes left on the fake E2B: %v", left)
	}
}

// gatewayPipes makes a directory for the gateway socket and the fake
// service's per-sandbox sockets, and the network joining them: a hosted
// service's sandboxes reach the gateway over its network; the fake's
// sandboxes reach it on a socket of their own each, which the test joins
// to the job's gateway socket.
func gatewayPipes(t *testing.T) (dir, sock string, pipes *stasistest.Network) {
	dir, err := os.MkdirTemp("", "stasis-gw-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock = filepath.Join(dir, "gw.sock")
	pipes = stasistest.NewNetwork(sock)
	t.Cleanup(pipes.Close)
	return dir, sock, pipes
}
