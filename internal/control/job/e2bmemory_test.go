package job_test

import (
	"context"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"stasis/internal/control/job"
	"stasis/internal/insandbox/harness"
	"stasis/internal/providers/e2b"
	"stasis/internal/providers/e2b/e2bfake"
	"stasis/internal/providers/microvm"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// TestRunOnE2BFakeMemorySnapshots: the main job on the E2B provider
// against an AgentENV-like service: the fake E2B backed by microVMs on the
// Debian image, whose snapshots keep processes, and which sets a resumed
// guest's wall clock to the host's (uptime goes on from the snapshot).
// Through the E2B API alone, stasis pauses by hold, the crash kills the
// server and every sandbox, and the restore resumes the episodes in place; the clock policy (continuous) undoes the service's
// step, which the report shows: back by about the time between the pause
// and the restore, never before the pause.
func TestRunOnE2BFakeMemorySnapshots(t *testing.T) {
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	gwDir, sock, pipes := gatewayPipes(t)
	ro := map[string]string{}
	if prefix, ok := harness.OpenCodeBind(); ok {
		ro[prefix] = harness.OpenCodeSandboxDir // the template has OpenCode
	}
	backend, err := microvm.New(context.Background(), microvm.Options{
		Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GuestBinary: stasistest.StaticBinary(t),
		GatewayDir: gwDir, GatewayServer: pipes, ReadOnlyBinds: ro,
	})
	if err != nil {
		t.Fatal(err)
	}
	// The template is ready before the run, as a service's is: the
	// image unpacked and its block image built, OpenCode's disk too (an
	// E2B create must answer within the client's timeout).
	ref := stasistest.TestImage(t)
	warm, err := backend.Create(context.Background(), sandbox.Spec{Image: ref, Expiry: time.Now().Add(5 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	if err := backend.Delete(context.Background(), warm.ID); err != nil {
		t.Fatal(err)
	}
	fake := e2bfake.New(backend, e2bfake.Options{APIKey: "test-key", HostClockOnResume: true, Image: ref})
	srv := httptest.NewServer(fake)
	t.Cleanup(func() { fake.Close(); srv.Close() })
	for k, v := range map[string]string{e2b.EnvAPIKey: "test-key", e2b.EnvDomain: "", e2b.EnvAPIURL: srv.URL, e2b.EnvSandboxURL: srv.URL} {
		t.Setenv(k, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	t.Setenv("TMPDIR", t.TempDir())
	// Mini by default: OpenCode resumed in place in a microVM guest is
	// TestRunWithCrashOnImageMicroVM's and episode's
	// TestMicroVMOpenCodeForkOfTwoResumesInPlace's, and OpenCode in a TCG
	// guest costs minutes; STASIS_TEST_E2B_HARNESS=mixed or opencode runs
	// it here too.
	h := os.Getenv("STASIS_TEST_E2B_HARNESS")
	if h == "" {
		h = "mini"
	}
	start := time.Now()
	rep, err := job.Run(ctx, job.Options{
		Tasks: "builtin", N: 2, Harness: h, Provider: "e2b", CheckpointAt: 0.4, Crash: true,
		GatewayListen: "unix:" + sock, GatewayURL: "http://" + microvm.GatewayAddr,
		Exe: stasistest.Exe(), ExeEnv: stasistest.Env, TokenDelay: 3 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Episodes) != 2 || rep.Resolved != 2 || rep.Restore == nil {
		t.Fatalf("report: %+v", rep)
	}
	harnesses := map[string]bool{}
	for _, e := range rep.Episodes {
		harnesses[e.Harness] = true
		step := "none"
		if e.ClockStep != nil {
			step = time.Duration(*e.ClockStep * float64(time.Second)).String()
		}
		t.Logf("%s (%s): resume %s, clock step %s", e.ID, e.Harness, e.Resume, step)
		if !e.LedgerVerified || e.Reward != 1 || e.Provider != "e2b" {
			t.Errorf("episode %+v", e)
		}
		if e.Resume == "none" {
			continue // ended before the checkpoint
		}
		if e.Resume != "in_place" {
			t.Errorf("%s: resume %s (%s), want in_place: the service's snapshots keep processes", e.ID, e.Resume, e.ResumeWhy)
			continue
		}
		// The service put the guest at the host's time, ahead of the
		// continuous clock by the time the episode spent paused; stasis
		// set it back by that much, and by no more than the whole run.
		if e.ClockStep == nil || *e.ClockStep >= 0 || -*e.ClockStep > time.Since(start).Seconds() {
			t.Errorf("%s: clock step %v, want back by the paused time (under %s)", e.ID, e.ClockStep, time.Since(start))
		}
	}
	if h == "mixed" && (!harnesses["opencode"] || !harnesses["mini"]) {
		t.Errorf("harnesses %v: want both", harnesses)
	}
	if left := fake.Sandboxes(); len(left) != 0 {
		t.Errorf("sandboxes left on the fake E2B: %v", left)
	}
	if left, err := backend.List(ctx, nil); err != nil || len(left) != 0 {
		t.Fatalf("microVMs left on the service: %v %v", left, err)
	}
}
