package blob

import (
	"bytes"
	"context"
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

// Bad keys (see badKeys, which the conformance tests run through every
// entry point) never reach a file outside the store's directory.
func TestDirBadKeysStayInside(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	// A file outside the store that a traversal would reach.
	outside := filepath.Join(filepath.Dir(d.Path()), "secret")
	if err := os.WriteFile(outside, []byte("s"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, k := range badKeys {
		_ = d.Put(ctx, k, []byte("x"))
		_, _ = d.Get(ctx, k)
		_ = d.Delete(ctx, k)
	}
	if b, err := os.ReadFile(outside); err != nil || string(b) != "s" {
		t.Fatalf("file outside the store touched: %q %v", b, err)
	}
}

// Put writes a loose blob where the layout says, and nothing beside it.
func TestDirPutLayout(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	k := key('a')
	for i := 0; i < 2; i++ {
		if err := d.Put(ctx, k, []byte("hello")); err != nil {
			t.Fatal(err)
		}
	}
	ents, err := os.ReadDir(filepath.Join(d.Path(), k[:2]))
	if err != nil || len(ents) != 1 || ents[0].Name() != k {
		t.Fatalf("fan-out directory holds %v (%v), want just the blob", ents, err)
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

// Walk passes over what is in the store's directory but is not a blob.
func TestDirWalkPassesOverJunk(t *testing.T) {
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
