package ceph

import "testing"

func TestParseImageSpec(t *testing.T) {
	good := map[string]ImageSpec{
		"img":             {Pool: "rbd", Image: "img"},
		"p/img":           {Pool: "p", Image: "img"},
		"p/ns/img":        {Pool: "p", Namespace: "ns", Image: "img"},
		"p/ns/img@s1":     {Pool: "p", Namespace: "ns", Image: "img", Snap: "s1"},
		"img@snap":        {Pool: "rbd", Image: "img", Snap: "snap"},
		"pool-1/disk.raw": {Pool: "pool-1", Image: "disk.raw"},
	}
	for in, want := range good {
		got, err := ParseImageSpec(in)
		if err != nil || got != want {
			t.Errorf("ParseImageSpec(%q) = %+v, %v; want %+v", in, got, err, want)
		}
		if got.String() != in && "rbd/"+in != got.String() {
			t.Errorf("String() = %q for %q", got.String(), in)
		}
	}
	for _, in := range []string{"", "/img", "p/", "p//img", "a/b/c/d", "img@", "img@a/b", "p/img@s@t"} {
		if _, err := ParseImageSpec(in); err == nil {
			t.Errorf("ParseImageSpec(%q) accepted", in)
		}
	}
}
