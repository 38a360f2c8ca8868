package stasistest_test

import (
	"context"
	"testing"
	"time"

	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// A world runs an episode as the server would: its second model call is
// held at the gateway; the host side crashes and opens again on the same
// state, finding the episode still live; released, the episode finishes
// and its verdict is a pass.
func TestWorldHoldsCrashesAndReopens(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	w := stasistest.NewWorld(t)
	h := w.Hold("ep-1", 2)
	if _, err := w.Coordinator.Start(ctx, "ep-1", "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	if err := h.Wait(ctx, 1); err != nil {
		t.Fatalf("call 2 never arrived: %v", err)
	}
	if n := w.Hold("ep-1", 9).Held(); n != 0 {
		t.Fatalf("a hold of a call not yet made holds %d", n)
	}
	w.Crash()
	w.Reopen()
	if _, live := w.Coordinator.Live("ep-1"); !live {
		t.Fatalf("the episode is not live after the host side came back: %v", w.Coordinator.LiveIDs())
	}
	h.Release()
	if _, err := w.Coordinator.Wait(ctx, "ep-1"); err != nil {
		t.Fatal(err)
	}
	v, _, err := w.Coordinator.Verify(ctx, "ep-1")
	if err != nil {
		t.Fatal(err)
	}
	if v.Reward != 1 {
		t.Fatalf("reward %v: %+v", v.Reward, v)
	}
	if err := w.Coordinator.Retire(ctx, "ep-1"); err != nil {
		t.Fatal(err)
	}
}
