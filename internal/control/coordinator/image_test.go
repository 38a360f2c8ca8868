package coordinator_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/coordinator"
	"stasis/internal/control/system"
	"stasis/internal/sandboxbin"
	"stasis/internal/stasistest"
)

// TestRestoreNeedsItsImage: an episode on an image is recorded with the
// image's digest and reference; a restore whose image is gone from the
// host is refused before it touches the provider, saying how to pull it;
// with PullImages it pulls it again and the episode runs to its reward.
func TestRestoreNeedsItsImage(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	t.Setenv(sandboxbin.Env, stasistest.StaticBinary(t))
	// A small image: what is tested is the record and the pull, and the
	// Debian image's unpack, done twice, is minutes under a loaded CI.
	// Busybox has no C library for the race-built test binary, so the
	// sandboxes get the static in-sandbox build.
	ref := stasistest.BusyboxImage(t)
	w := newWorld(t, func(c *system.Config) {
		c.Image = ref
		c.Binary, c.BinaryEnv = stasistest.StaticBinary(t), nil
	})
	c := w.Coordinator
	h := w.Hold("ep-img", 2)
	if _, err := c.Start(ctx, "ep-img", "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, h, "call 2 of ep-img")
	if _, err := c.Prepare(ctx, "ckpt-img"); err != nil {
		t.Fatal(err)
	}
	_, recs, err := w.Store.Get(ctx, "ckpt-img")
	if err != nil || len(recs) != 1 {
		t.Fatalf("records: %+v %v", recs, err)
	}
	rec := recs[0]
	if !strings.HasPrefix(rec.Image, "sha256:") || rec.ImageRef != ref {
		t.Fatalf("the record's image: %q from %q, want a digest from %q", rec.Image, rec.ImageRef, ref)
	}
	h.Release()
	if _, err := c.Wait(ctx, "ep-img"); err != nil {
		t.Fatal(err)
	}
	if err := c.Retire(ctx, "ep-img"); err != nil {
		t.Fatal(err)
	}
	// The image goes (the snapshot still names it; an operator forced it).
	if err := w.local.Images().Remove(rec.Image, nil); err != nil {
		t.Fatal(err)
	}
	// Retired: the restore brings it back when named.
	named := coordinator.RestoreOptions{Episodes: []string{"ep-img"}}
	_, err = c.RestoreWith(ctx, "ckpt-img", named)
	if err == nil || !strings.Contains(err.Error(), "no longer on this host") || !strings.Contains(err.Error(), "stasis image pull "+ref) {
		t.Fatalf("restore without the image: %v", err)
	}
	if left, _ := w.local.List(ctx, nil); len(left) != 0 {
		t.Fatalf("a refused restore made sandboxes: %v", left)
	}
	// The system again, its restores pulling missing images. It has no
	// default image: a local provider would pull that at Open, and the
	// pull tested is the restore's.
	w.Crash()
	w.ReopenWith(func(c *system.Config) { c.PullImages, c.Image = true, "" })
	pc := w.Coordinator
	if _, err := pc.RestoreWith(ctx, "ckpt-img", named); err != nil {
		t.Fatalf("restore that pulls the image again: %v", err)
	}
	if _, err := w.local.Images().Get(rec.Image); err != nil {
		t.Errorf("the image after the restore: %v", err)
	}
	if _, err := pc.Wait(ctx, "ep-img"); err != nil {
		t.Fatal(err)
	}
	v, _, err := pc.Verify(ctx, "ep-img")
	if err != nil || v.Reward != 1 {
		t.Fatalf("reward %d %v\n%s", v.Reward, err, v.Output)
	}
	if v.Environment != "host" && !strings.Contains(v.Environment, "image") {
		t.Logf("environment %q", v.Environment)
	}
	if err := pc.Retire(ctx, "ep-img"); err != nil {
		t.Fatal(err)
	}
}
