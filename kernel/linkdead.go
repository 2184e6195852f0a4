package kernel

import (
	"context"
	"fmt"

	"github.com/mdlayher/genetlink"
)

// WatchLinkDead calls fn with the device index each time the kernel
// reports (LINK_DEAD multicast) that one of a device's connections died —
// a request timed out or the socket failed. It returns when ctx ends.
func WatchLinkDead(ctx context.Context, fn func(index int)) error {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return fmt.Errorf("generic netlink: %w", err)
	}
	defer c.Close()
	fam, err := c.GetFamily(familyName)
	if err != nil {
		return ErrNoFamily
	}
	var group uint32
	for _, g := range fam.Groups {
		if g.Name == familyGroup {
			group = g.ID
		}
	}
	if group == 0 {
		return fmt.Errorf("genl family %s has no group %s", familyName, familyGroup)
	}
	if err := c.JoinGroup(group); err != nil {
		return fmt.Errorf("join %s: %w", familyGroup, err)
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	for {
		msgs, _, err := c.Receive()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("receive %s: %w", familyGroup, err)
		}
		for _, m := range msgs {
			if idx, ok := linkDeadIndex(m); ok {
				fn(idx)
			}
		}
	}
}

func linkDeadIndex(m genetlink.Message) (int, bool) {
	if m.Header.Command != cmdLinkDead {
		return 0, false
	}
	return decodeIndex(m.Data)
}
