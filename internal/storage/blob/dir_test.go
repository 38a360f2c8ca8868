package blob

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

func key(c byte) string { return strings.Repeat(string(c), KeyLen) }

func newDir(t *testing.T) *Dir {
	t.Helper()
	d, err := NewDir(filepath.Join(t.TempDir(), "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestKeyValidation(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	// A file outside the store that a traversal would reach.
	outside := filepath.Join(filepath.Dir(d.Path()), "secret")
	if err := os.WriteFile(outside, []byte("s"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := []string{
		"",
		"ab",
		key('a')[:KeyLen-1],
		key('a') + "0",
		strings.ToUpper(key('a')),
		"../secret",
		"../../../../../../../../../../../../../../../../../../../etc/passwd",
		"aa/" + key('a')[:KeyLen-3],
		"aa/../../" + key('b')[:KeyLen-9],
		strings.Repeat(".", KeyLen),
		"/" + key('a')[1:],
		key('a')[:KeyLen-1] + "/",
		key('a')[:KeyLen-1] + "g",
		key('a')[:KeyLen-1] + "\x00",
		strings.Repeat("é", KeyLen/2),
	}
	for _, k := range bad {
		if ValidKey(k) {
			t.Errorf("ValidKey(%q) = true", k)
		}
		if err := d.Put(ctx, k, []byte("x")); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("Put(%q): %v, want ErrInvalidKey", k, err)
		}
		if _, err := d.Get(ctx, k); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("Get(%q): %v, want ErrInvalidKey", k, err)
		}
		if _, err := d.Has(ctx, k); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("Has(%q): %v, want ErrInvalidKey", k, err)
		}
		if err := d.Delete(ctx, k); !errors.Is(err, ErrInvalidKey) {
			t.Errorf("Delete(%q): %v, want ErrInvalidKey", k, err)
		}
	}
	if b, err := os.ReadFile(outside); err != nil || string(b) != "s" {
		t.Fatalf("file outside the store touched: %q %v", b, err)
	}
	for _, k := range []string{key('0'), key('f'), "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"} {
		if !ValidKey(k) {
			t.Errorf("ValidKey(%q) = false", k)
		}
	}
}

func TestPutGetHasIdempotent(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	k := key('a')
	if ok, err := d.Has(ctx, k); err != nil || ok {
		t.Fatalf("Has before Put: %v %v", ok, err)
	}
	if _, err := d.Get(ctx, k); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get before Put: %v, want ErrNotFound", err)
	}
	for i := 0; i < 3; i++ {
		if err := d.Put(ctx, k, []byte("hello")); err != nil {
			t.Fatalf("Put #%d: %v", i, err)
		}
	}
	b, err := d.Get(ctx, k)
	if err != nil || string(b) != "hello" {
		t.Fatalf("Get: %q %v", b, err)
	}
	if ok, err := d.Has(ctx, k); err != nil || !ok {
		t.Fatalf("Has after Put: %v %v", ok, err)
	}
	// The blob is where the layout says, and nothing else is left beside it.
	ents, err := os.ReadDir(filepath.Join(d.Path(), k[:2]))
	if err != nil || len(ents) != 1 || ents[0].Name() != k {
		t.Fatalf("fan-out directory holds %v (%v), want just the blob", ents, err)
	}
	// Empty blobs are blobs.
	if err := d.Put(ctx, key('e'), nil); err != nil {
		t.Fatal(err)
	}
	if b, err := d.Get(ctx, key('e')); err != nil || len(b) != 0 {
		t.Fatalf("empty blob: %q %v", b, err)
	}
}

func TestPutRepairsDamagedBlob(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	k := key('c')
	if err := d.Put(ctx, k, []byte("content")); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(d.Path(), k[:2], k), 3); err != nil {
		t.Fatal(err)
	}
	if err := d.Put(ctx, k, []byte("content")); err != nil {
		t.Fatal(err)
	}
	if b, _ := d.Get(ctx, k); string(b) != "content" {
		t.Fatalf("after repairing Put: %q", b)
	}
}

func TestDeleteIdempotent(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	k := key('d')
	if err := d.Delete(ctx, k); err != nil {
		t.Fatalf("Delete of a missing key: %v", err)
	}
	if err := d.Put(ctx, k, []byte("x")); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := d.Delete(ctx, k); err != nil {
			t.Fatalf("Delete #%d: %v", i, err)
		}
	}
	if ok, _ := d.Has(ctx, k); ok {
		t.Fatal("blob still there after Delete")
	}
	if _, err := d.Get(ctx, k); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after Delete: %v", err)
	}
}

func TestWalk(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	want := map[string]int64{}
	for i, c := range []byte("0123456789abcdef") {
		k := key(c)
		data := bytes.Repeat([]byte{c}, i*10)
		if err := d.Put(ctx, k, data); err != nil {
			t.Fatal(err)
		}
		want[k] = int64(len(data))
	}
	k2 := "ab" + key('1')[2:] // shares a fan-out directory with nothing else
	if err := d.Put(ctx, k2, []byte("y")); err != nil {
		t.Fatal(err)
	}
	want[k2] = 1
	// Things in the store's directory that are not blobs: a temporary file
	// left by a crash, a file whose name is a key in the wrong fan-out
	// directory, a stray file and directory at the top.
	junk := map[string]string{
		filepath.Join("aa", ".tmp-crash"):              "partial",
		filepath.Join("aa", key('b')):                  "misfiled",
		"README":                                       "x",
		filepath.Join("zz", key('a')):                  "not a fan-out dir",
		filepath.Join("aa", strings.ToUpper(key('a'))): "uppercase",
	}
	for p, c := range junk {
		full := filepath.Join(d.Path(), p)
		if err := os.MkdirAll(filepath.Dir(full), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]int64{}
	if err := d.Walk(ctx, func(k string, size int64) error {
		if _, dup := got[k]; dup {
			t.Errorf("Walk gave %s twice", k)
		}
		got[k] = size
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("Walk gave %d blobs, want %d: %v", len(got), len(want), keys(got))
	}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("Walk: %s size %d, want %d", k, got[k], n)
		}
	}
	// An error from fn stops the walk and comes back.
	stop := errors.New("stop")
	calls := 0
	if err := d.Walk(ctx, func(string, int64) error { calls++; return stop }); !errors.Is(err, stop) || calls != 1 {
		t.Fatalf("Walk with failing fn: %v after %d calls", err, calls)
	}
	// A cancelled context stops it too.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := d.Walk(cctx, func(string, int64) error { return nil }); !errors.Is(err, context.Canceled) {
		t.Fatalf("Walk with cancelled context: %v", err)
	}
}

func TestNewDirRefusesFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := NewDir(p); err == nil {
		t.Fatal("NewDir on a regular file succeeded")
	}
}

func keys(m map[string]int64) []string {
	var s []string
	for k := range m {
		s = append(s, k)
	}
	sort.Strings(s)
	return s
}
