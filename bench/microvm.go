package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"stasis/sandbox"
	"stasis/sandbox/microvm"
)

// MicroVMOptions configure MicroVM.
type MicroVMOptions struct {
	Exe, GuestBinary string   // host stasis (keepers) and the guest's static stasis
	Env              []string // extra environment for Exe
	Home             string   // state directory (default: a new temporary one, removed after)
	Mem              []int    // guest memory sizes, MiB (default 128, 256, 512)
	// Fill is the share of guest memory filled with random data in the
	// guest's RAM file system before the first snapshot (default 0.25): an
	// idle guest's state is the same at any size.
	Fill     float64
	Progress io.Writer
}

// MicroVMRow is one guest size's figures.
type MicroVMRow struct {
	MemMiB int `json:"mem_mib"`
	// StateBytes is what the first snapshot's migration stream holds;
	// NewBytes what it added to the store (what it wrote); SecondNewBytes
	// what a second snapshot of the same VM (a second later) added.
	StateBytes     int64 `json:"state_bytes"`
	NewBytes       int64 `json:"new_bytes"`
	SecondNewBytes int64 `json:"second_new_bytes"`
	// Snapshot: stop, the migration written into a pack file of the
	// store and staged as it is written (cut, hashed), continue, made
	// durable; the median of 3 first
	// snapshots of 3 VMs. Paused: how long the guest was stopped.
	// DDWrite: dd writing NewBytes to a file in the state directory with
	// conv=fsync, right after each snapshot; SnapshotOverDD the median
	// of the three ratios. Cut: how the state was cut into chunks.
	Snapshot       time.Duration `json:"snapshot_ns"`
	Paused         time.Duration `json:"guest_paused_ns"`
	DDWrite        time.Duration `json:"dd_write_ns"`
	SnapshotOverDD float64       `json:"snapshot_over_dd"`
	Cut            string        `json:"cut"`
	// Restore: Fork of 1 to the end of the fork's first exec, the source
	// deleted first (as after a crash); median of 3. DDRead: dd reading
	// NewBytes back.
	Restore time.Duration `json:"restore_to_first_exec_ns"`
	DDRead  time.Duration `json:"dd_read_ns"`
	// ColdBoot: Create to the end of the first exec (median of 3).
	ColdBoot time.Duration `json:"cold_boot_to_first_exec_ns"`
	// Fork4: Fork of 4 to the end of the first exec in each.
	Fork4 time.Duration `json:"fork4_to_first_exec_ns"`
}

// MicroVMResult is the microVM provider's snapshot, restore and boot
// figures, beside dd in the same run.
type MicroVMResult struct {
	Accel  string       `json:"accel"`
	Reason string       `json:"accel_reason"`
	Kernel string       `json:"kernel"`
	Rows   []MicroVMRow `json:"rows"`
}

// MicroVM measures, per guest size: cold boot to first exec; a snapshot
// of a guest with Fill of its memory in use, against dd writing as many
// bytes; a second snapshot's new bytes; restore to first exec, against dd
// reading them; a fork of 4.
func MicroVM(ctx context.Context, o MicroVMOptions) (MicroVMResult, error) {
	var res MicroVMResult
	if len(o.Mem) == 0 {
		o.Mem = []int{128, 256, 512}
	}
	if o.Fill == 0 {
		o.Fill = 0.25
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	home, remove, err := dirOr(o.Home, "stasis-bench-microvm-")
	if err != nil {
		return res, err
	}
	defer remove()
	o.Home = home
	for _, mem := range o.Mem {
		p, err := microvm.New(ctx, microvm.Options{Home: filepath.Join(o.Home, strconv.Itoa(mem)), Exe: o.Exe, ExeEnv: o.Env, GuestBinary: o.GuestBinary, MemMiB: mem})
		if err != nil {
			return res, err
		}
		res.Accel, res.Reason = p.Accel()
		res.Kernel = p.Kernel().Version
		fmt.Fprintf(o.Progress, "guest of %d MiB (%s) ...\n", mem, res.Accel)
		row, err := microVMRow(ctx, p, mem, o.Fill, filepath.Join(o.Home, strconv.Itoa(mem)))
		if err != nil {
			return res, fmt.Errorf("guest of %d MiB: %w", mem, err)
		}
		res.Rows = append(res.Rows, row)
	}
	return res, nil
}

// reps is how many cold boots and restores each row takes the median of.
const reps = 3

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func microVMRow(ctx context.Context, p *microvm.Provider, mem int, fill float64, dir string) (row MicroVMRow, err error) {
	row.MemMiB = mem
	var made []string
	defer func() {
		for _, id := range made {
			if derr := p.Delete(context.WithoutCancel(ctx), id); derr != nil && err == nil {
				err = derr
			}
		}
	}()
	exec1 := func(id string, script string) error {
		var out bytes.Buffer
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out, Timeout: 5 * time.Minute})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("%q exited %d: %s", script, res.ExitCode, strings.TrimSpace(out.String()))
		}
		return err
	}
	expiry := time.Now().Add(time.Hour)
	ddFile := filepath.Join(dir, "dd.bin")
	dd := func(args ...string) (time.Duration, error) {
		t0 := time.Now()
		if out, err := exec.CommandContext(ctx, "dd", args...).CombinedOutput(); err != nil {
			return 0, fmt.Errorf("dd: %v: %s", err, out)
		}
		return time.Since(t0), nil
	}
	// Three rounds, each taking the median: a cold boot; fill of the
	// memory filled; the first snapshot of that VM; dd writing as
	// many bytes as the snapshot added to the store, right after it.
	// The first guest of a run is the slowest (QEMU and the image are not
	// in the page cache yet). The last VM and its snapshot stay, for the
	// second snapshot and the restores; the others are deleted, their
	// snapshots too, so that each round's snapshot starts from an empty
	// store.
	var boots, snaps, paused, dds []time.Duration
	var ratios []float64
	var src sandbox.Info
	var s1 sandbox.SnapshotInfo
	for i := 0; i < reps; i++ {
		t0 := time.Now()
		if src, err = p.Create(ctx, sandbox.Spec{Expiry: expiry}); err != nil {
			return row, err
		}
		made = append(made, src.ID)
		if err := exec1(src.ID, "true"); err != nil {
			return row, err
		}
		boots = append(boots, time.Since(t0))

		// Fill a share of the guest's memory (its RAM file system) with
		// data that does not compress or deduplicate.
		if fillMiB := int(float64(mem) * fill); fillMiB > 0 {
			if err := exec1(src.ID, fmt.Sprintf("dd if=/dev/urandom of=/tmp/fill bs=1048576 count=%d 2>/dev/null", fillMiB)); err != nil {
				return row, err
			}
		}
		t0 = time.Now()
		if s1, err = p.Snapshot(ctx, src.ID, ""); err != nil {
			return row, err
		}
		took := time.Since(t0)
		defer p.DeleteSnapshot(context.WithoutCancel(ctx), s1.ID)
		si, err := p.Saved(s1.ID)
		if err != nil {
			return row, err
		}
		if !si.ByAddress() {
			return row, fmt.Errorf("the state was not cut by guest address: %s", si.Cut)
		}
		row.Cut = si.Cut
		// dd: the bytes the snapshot wrote, made durable, on the same
		// file system, in the same run.
		count := (s1.NewBytes + 1<<20 - 1) >> 20
		ddt, err := dd("if=/dev/zero", "of="+ddFile, "bs=1M", "count="+strconv.FormatInt(count, 10), "conv=fsync")
		if err != nil {
			return row, err
		}
		snaps, paused, dds = append(snaps, took), append(paused, si.Paused), append(dds, ddt)
		ratios = append(ratios, float64(took)/float64(ddt))
		if i < reps-1 {
			if err := p.Delete(ctx, src.ID); err != nil {
				return row, err
			}
			made = made[:len(made)-1]
			if err := p.DeleteSnapshot(ctx, s1.ID); err != nil {
				return row, err
			}
		}
	}
	row.ColdBoot, row.Snapshot, row.Paused, row.DDWrite = median(boots), median(snaps), median(paused), median(dds)
	sort.Float64s(ratios)
	row.SnapshotOverDD = ratios[len(ratios)/2]
	row.StateBytes, row.NewBytes = s1.Bytes, s1.NewBytes

	if err := exec1(src.ID, "sleep 1"); err != nil {
		return row, err
	}
	s2, err := p.Snapshot(ctx, src.ID, "")
	if err != nil {
		return row, err
	}
	defer p.DeleteSnapshot(context.WithoutCancel(ctx), s2.ID)
	row.SecondNewBytes = s2.NewBytes

	if row.DDRead, err = dd("if="+ddFile, "of=/dev/null", "bs=1M"); err != nil {
		return row, err
	}
	_ = os.Remove(ddFile)

	// Restores are timed as after a crash: the source VM is gone. (Under
	// TCG a guest that has just been saved spends a second re-translating
	// its code, which a restore running beside it would share the CPU
	// with.)
	if err := p.Delete(ctx, src.ID); err != nil {
		return row, err
	}
	made = made[1:]

	var restores []time.Duration
	for i := 0; i < reps; i++ {
		t0 := time.Now()
		f1, err := p.Fork(ctx, s1.ID, 1, sandbox.ForkSpec{Expiry: expiry})
		if err != nil {
			return row, err
		}
		if err := exec1(f1[0].ID, "true"); err != nil {
			_ = p.Delete(ctx, f1[0].ID)
			return row, err
		}
		restores = append(restores, time.Since(t0))
		if err := p.Delete(ctx, f1[0].ID); err != nil {
			return row, err
		}
	}
	row.Restore = median(restores)

	t0 := time.Now()
	f4, err := p.Fork(ctx, s1.ID, 4, sandbox.ForkSpec{Expiry: expiry})
	if err != nil {
		return row, err
	}
	for _, f := range f4 {
		made = append(made, f.ID)
	}
	for _, f := range f4 {
		if err := exec1(f.ID, "true"); err != nil {
			return row, err
		}
	}
	row.Fork4 = time.Since(t0)
	return row, nil
}
