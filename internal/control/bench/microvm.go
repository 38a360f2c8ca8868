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

	"stasis/internal/providers/microvm"
	"stasis/sandbox"
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
	b := &vmBench{ctx: ctx, p: p, ddFile: filepath.Join(dir, "dd.bin")}
	defer func() {
		if cerr := b.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	b.expiry = time.Now().Add(time.Hour)
	src, s1, err := b.firstSnapshots(&row, mem, fill)
	if err != nil {
		return row, err
	}

	if err := b.exec1(src.ID, "sleep 1"); err != nil {
		return row, err
	}
	s2, err := p.Snapshot(ctx, src.ID, "")
	if err != nil {
		return row, err
	}
	b.snaps = append(b.snaps, s2.ID)
	row.SecondNewBytes = s2.NewBytes

	if row.DDRead, err = b.dd("if="+b.ddFile, "of=/dev/null", "bs=1M"); err != nil {
		return row, err
	}
	_ = os.Remove(b.ddFile)

	// Restores are timed as after a crash: the source VM is gone. (Under
	// TCG a guest that has just been saved spends a second re-translating
	// its code, which a restore running beside it would share the CPU
	// with.)
	if err := p.Delete(ctx, src.ID); err != nil {
		return row, err
	}
	b.made = b.made[1:]
	if row.Restore, err = b.restores(s1.ID); err != nil {
		return row, err
	}
	row.Fork4, err = b.fork4(s1.ID)
	return row, err
}

// vmBench measures one guest size on p. What it makes is deleted at the
// end (cleanup): the snapshots, last first, then the sandboxes.
type vmBench struct {
	ctx    context.Context
	p      *microvm.Provider
	expiry time.Time
	ddFile string
	made   []string // sandboxes
	snaps  []string // snapshots
}

func (b *vmBench) cleanup() error {
	for i := len(b.snaps) - 1; i >= 0; i-- {
		b.p.DeleteSnapshot(context.WithoutCancel(b.ctx), b.snaps[i])
	}
	var err error
	for _, id := range b.made {
		if derr := b.p.Delete(context.WithoutCancel(b.ctx), id); derr != nil && err == nil {
			err = derr
		}
	}
	return err
}

// exec1 runs a shell script in a sandbox; it fails unless it exits 0.
func (b *vmBench) exec1(id string, script string) error {
	var out bytes.Buffer
	res, err := b.p.Exec(b.ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out, Timeout: 5 * time.Minute})
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("%q exited %d: %s", script, res.ExitCode, strings.TrimSpace(out.String()))
	}
	return err
}

// dd times dd with args.
func (b *vmBench) dd(args ...string) (time.Duration, error) {
	t0 := time.Now()
	if out, err := exec.CommandContext(b.ctx, "dd", args...).CombinedOutput(); err != nil {
		return 0, fmt.Errorf("dd: %v: %s", err, out)
	}
	return time.Since(t0), nil
}

// firstSnapshots takes three rounds, each taking the median: a cold boot;
// fill of the memory filled; the first snapshot of that VM; dd writing as
// many bytes as the snapshot added to the store, right after it. The
// first guest of a run is the slowest (QEMU and the image are not in the
// page cache yet). The last VM (src) and its snapshot (s1) stay, for the
// second snapshot and the restores; the others are deleted, their
// snapshots too, so that each round's snapshot starts from an empty store.
func (b *vmBench) firstSnapshots(row *MicroVMRow, mem int, fill float64) (src sandbox.Info, s1 sandbox.SnapshotInfo, err error) {
	p, ctx := b.p, b.ctx
	var boots, snaps, paused, dds []time.Duration
	var ratios []float64
	for i := 0; i < reps; i++ {
		t0 := time.Now()
		if src, err = p.Create(ctx, sandbox.Spec{Expiry: b.expiry}); err != nil {
			return src, s1, err
		}
		b.made = append(b.made, src.ID)
		if err := b.exec1(src.ID, "true"); err != nil {
			return src, s1, err
		}
		boots = append(boots, time.Since(t0))

		// Fill a share of the guest's memory (its RAM file system) with
		// data that does not compress or deduplicate.
		if fillMiB := int(float64(mem) * fill); fillMiB > 0 {
			if err := b.exec1(src.ID, fmt.Sprintf("dd if=/dev/urandom of=/tmp/fill bs=1048576 count=%d 2>/dev/null", fillMiB)); err != nil {
				return src, s1, err
			}
		}
		t0 = time.Now()
		if s1, err = p.Snapshot(ctx, src.ID, ""); err != nil {
			return src, s1, err
		}
		took := time.Since(t0)
		b.snaps = append(b.snaps, s1.ID)
		si, err := p.Saved(s1.ID)
		if err != nil {
			return src, s1, err
		}
		if !si.ByAddress() {
			return src, s1, fmt.Errorf("the state was not cut by guest address: %s", si.Cut)
		}
		row.Cut = si.Cut
		// dd: the bytes the snapshot wrote, made durable, on the same
		// file system, in the same run.
		count := (s1.NewBytes + 1<<20 - 1) >> 20
		ddt, err := b.dd("if=/dev/zero", "of="+b.ddFile, "bs=1M", "count="+strconv.FormatInt(count, 10), "conv=fsync")
		if err != nil {
			return src, s1, err
		}
		snaps, paused, dds = append(snaps, took), append(paused, si.Paused), append(dds, ddt)
		ratios = append(ratios, float64(took)/float64(ddt))
		if i < reps-1 {
			if err := p.Delete(ctx, src.ID); err != nil {
				return src, s1, err
			}
			b.made = b.made[:len(b.made)-1]
			if err := p.DeleteSnapshot(ctx, s1.ID); err != nil {
				return src, s1, err
			}
		}
	}
	row.ColdBoot, row.Snapshot, row.Paused, row.DDWrite = median(boots), median(snaps), median(paused), median(dds)
	sort.Float64s(ratios)
	row.SnapshotOverDD = ratios[len(ratios)/2]
	row.StateBytes, row.NewBytes = s1.Bytes, s1.NewBytes
	return src, s1, nil
}

// restores times, reps times, a fork of 1 of snapshot to the end of its
// first exec: the median.
func (b *vmBench) restores(snapshot string) (time.Duration, error) {
	var restores []time.Duration
	for i := 0; i < reps; i++ {
		t0 := time.Now()
		f1, err := b.p.Fork(b.ctx, snapshot, 1, sandbox.ForkSpec{Expiry: b.expiry})
		if err != nil {
			return 0, err
		}
		if err := b.exec1(f1[0].ID, "true"); err != nil {
			_ = b.p.Delete(b.ctx, f1[0].ID)
			return 0, err
		}
		restores = append(restores, time.Since(t0))
		if err := b.p.Delete(b.ctx, f1[0].ID); err != nil {
			return 0, err
		}
	}
	return median(restores), nil
}

// fork4 times a fork of 4 of snapshot to the end of the first exec in
// each.
func (b *vmBench) fork4(snapshot string) (time.Duration, error) {
	t0 := time.Now()
	f4, err := b.p.Fork(b.ctx, snapshot, 4, sandbox.ForkSpec{Expiry: b.expiry})
	if err != nil {
		return 0, err
	}
	for _, f := range f4 {
		b.made = append(b.made, f.ID)
	}
	for _, f := range f4 {
		if err := b.exec1(f.ID, "true"); err != nil {
			return 0, err
		}
	}
	return time.Since(t0), nil
}
